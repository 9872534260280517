"""raylm's bundled demo model: what `LLM()`, `raylm serve` and the examples run when no model is named,
or when the model is named by its short name `raylm-demo-code`.

The folder `models/assets/raylm-demo-code/` is a tiny Llama that continues Python code,
trained offline on the Python standard library by `scripts/train_demo_model.py`; its
README.md is the model card. It ships as package data, so it is there in an installed
raylm as well as in a checkout.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_NAME = "raylm-demo-code"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def default_model_path() -> str:
    """The bundled demo model's folder, as a path `LLM(model=...)` accepts.

    Raises FileNotFoundError, naming the folder and the missing files, when the folder is
    incomplete (for example a checkout without the model, or a package built without its
    data files).
    """
    path = Path(__file__).resolve().parent / "assets" / DEMO_MODEL_NAME
    missing = [name for name in _REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"raylm's bundled demo model is missing {', '.join(missing)} in {path}. Name a model folder "
            f"explicitly (LLM(model=...) or `raylm serve MODEL_DIR`), or recreate the demo model with "
            f"`python scripts/train_demo_model.py`.")
    return str(path)


def resolve_model_path(model: str | None) -> str:
    """The folder a user's model argument means: no model (None or "") and the demo model's
    short name mean the bundled demo model's folder; anything else is returned as given.

    A folder that is really called `raylm-demo-code` in the working directory wins over
    the short name, as a path always does.
    """
    if not model or (model == DEMO_MODEL_NAME and not Path(model).is_dir()):
        return default_model_path()
    return model
