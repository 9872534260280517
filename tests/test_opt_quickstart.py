"""vLLM's quickstart on an OPT folder: `serve MODEL --chat-template FILE` answers chat
requests rendered with that template (OPT's tokenizer has none of its own)."""

from __future__ import annotations

import httpx
from server_process import running_server
from tiny_models import build_tiny_opt

TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def test_serve_an_opt_folder_with_a_chat_template_file(tmp_path):
    from transformers import AutoTokenizer

    model_dir = build_tiny_opt(tmp_path / "opt", seed=5)
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    with running_server([str(model_dir), "--chat-template", str(template), "--dtype", "float32"]) as (_, base_url):
        messages = [{"role": "user", "content": "Hello there"}]
        response = httpx.post(base_url + "/v1/chat/completions", timeout=60, json={
            "model": str(model_dir), "messages": messages, "max_tokens": 5, "temperature": 0})
        assert response.status_code == 200, response.text
        body = response.json()
        # The prompt is the template's rendering of the conversation, tokenized as is.
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        rendered = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                                 add_generation_prompt=True)
        assert rendered == "user: Hello there\nassistant:"
        assert body["usage"]["prompt_tokens"] == len(tokenizer.encode(rendered, add_special_tokens=False))
        assert body["choices"][0]["message"]["role"] == "assistant"
