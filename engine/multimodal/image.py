"""Images sent as URLs (OpenAI's chat `image_url` parts): data URLs only, every size bounded
before it is allocated. Remote (http, https, file) URLs are refused: the server fetches nothing."""

from __future__ import annotations

import base64
import binascii
import io
import re
from typing import Any

from raylm.engine.sampling_params import ParameterError

# The most bytes of one decoded image file (a 20 MiB PNG holds any photo a vision tower
# resizes to a few hundred pixels a side).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
# The most pixels of one decoded image (PIL's own decompression-bomb bound is 89M and only
# warns below twice that): 4096 x 4096. Checked from the header, before the pixels are decoded.
MAX_IMAGE_PIXELS = 4096 * 4096

_DATA_URL = re.compile(r"data:(?P<mime>image/[A-Za-z0-9.+-]+)?(?P<params>(;[^;,]*)*?);base64,", re.IGNORECASE)


def load_image_url(url: Any, param: str) -> Any:
    """The RGB PIL image of a `data:image/...;base64,...` URL; ParameterError naming `param` for
    a remote URL, bad base64, something that is not an image, or one over the bounds."""
    from PIL import Image

    if not isinstance(url, str):
        raise ParameterError(f"{param} must be a string URL, got {type(url).__name__}.", param)
    if re.match(r"(https?|file|ftp)://", url, re.IGNORECASE):
        raise ParameterError(f"{param}: remote images are not fetched; send the image inline as a data URL "
                             f"(data:image/png;base64,...).", param)
    match = _DATA_URL.match(url)
    if match is None:
        raise ParameterError(f"{param} must be a base64 data URL (data:image/png;base64,...), got "
                             f"{url[:40]!r}{'...' if len(url) > 40 else ''}.", param)
    payload = url[match.end():]
    # base64 is 4 characters per 3 bytes: bounded before decoding.
    if len(payload) > (MAX_IMAGE_BYTES + 2) // 3 * 4:
        raise ParameterError(f"{param}: the image is over {MAX_IMAGE_BYTES} bytes.", param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ParameterError(f"{param}: the data URL's payload is not valid base64.", param) from None
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise ParameterError(f"{param}: the data is not an image PIL can read ({error}).", param) from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ParameterError(f"{param}: the image is {width}x{height} pixels, more than {MAX_IMAGE_PIXELS} "
                             f"({int(MAX_IMAGE_PIXELS ** 0.5)}x{int(MAX_IMAGE_PIXELS ** 0.5)}).", param)
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise ParameterError(f"{param}: the image could not be decoded ({error}).", param) from None
