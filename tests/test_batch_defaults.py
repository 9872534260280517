"""The step's default token budget (max_num_batched_tokens): vLLM's table on a GPU, by who
builds the engine and the GPU's memory and name; 2048 on the CPU; a given value wins."""

import pytest

from raylm.engine.arg_utils import EngineArgs
from raylm.engine.config import default_max_num_batched_tokens
from raylm.engine.usage_context import UsageContext

GiB = 2**30
H100 = (80 * GiB, "NVIDIA H100 80GB HBM3")
H200 = (141 * GiB, "NVIDIA H200")
A100_80 = (80 * GiB, "NVIDIA A100-SXM4-80GB")
L4 = (23 * GiB, "NVIDIA L4")


# vLLM's EngineArgs.get_batch_defaults, read from its source: 16384 offline and 8192 served on
# GPUs of 70 GiB or more other than the A100; 8192 and 2048 on the rest; other contexts fall
# back to SchedulerConfig's 2048.
@pytest.mark.parametrize("gpu, context, expected", [
    (H100, UsageContext.LLM_CLASS, 16384),
    (H100, UsageContext.OPENAI_API_SERVER, 8192),
    (H100, UsageContext.ENGINE_CONTEXT, 2048),
    (H200, UsageContext.LLM_CLASS, 16384),
    (A100_80, UsageContext.LLM_CLASS, 8192),
    (A100_80, UsageContext.OPENAI_API_SERVER, 2048),
    (L4, UsageContext.LLM_CLASS, 8192),
    (L4, UsageContext.OPENAI_API_SERVER, 2048),
    (None, UsageContext.LLM_CLASS, 8192),  # a Ray driver that sees no GPU
    (None, UsageContext.UNKNOWN_CONTEXT, 2048),
])
def test_gpu_budget_follows_vllms_table(gpu, context, expected):
    assert default_max_num_batched_tokens("cuda", context, True, 4096, gpu) == expected


@pytest.mark.parametrize("context", list(UsageContext))
def test_cpu_budget_is_2048_in_every_context(context):
    assert default_max_num_batched_tokens("cpu", context, True, 32768, None) == 2048


@pytest.mark.parametrize("device, gpu", [("cpu", None), ("cuda", H100)])
def test_without_chunked_prefill_a_whole_prompt_fits(device, gpu):
    assert default_max_num_batched_tokens(device, UsageContext.LLM_CLASS, False, 32768, gpu) == 32768
    assert default_max_num_batched_tokens(device, UsageContext.LLM_CLASS, False, 512, gpu) == 2048


@pytest.mark.parametrize("context", [UsageContext.LLM_CLASS, UsageContext.OPENAI_API_SERVER])
def test_engine_config_on_the_cpu(llama_dir, context):
    default = EngineArgs(model=str(llama_dir), device="cpu").create_engine_config(context)
    assert default.scheduler_config.max_num_batched_tokens == 2048
    given = EngineArgs(model=str(llama_dir), device="cpu", max_num_batched_tokens=300).create_engine_config(context)
    assert given.scheduler_config.max_num_batched_tokens == 300
