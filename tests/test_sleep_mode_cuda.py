"""Sleep mode on a GPU (`cuda` tests, skipped elsewhere): sleep hands the KV cache, the
weights and the decode graphs' memory back to the device (the memory the process's
allocator reserves drops: `torch.cuda.mem_get_info` is the whole device's, which the GPU
check's other stages move at the same time), and after wake-up the CUDA graphs, captured again, give Hugging Face's greedy
tokens, at level 1 and after a level-2 sleep with the weights reloaded."""

from __future__ import annotations

import pytest
import torch

from hf_reference import hf_greedy

PROMPTS = [[5, 17, 300, 42], list(range(4, 40))]
MAX_TOKENS = 8
# fp32 KV of the tiny Llama: 65536 blocks are about 0.5 GiB, far above what the allocator
# may keep or lose elsewhere between two readings.
NUM_BLOCKS = 65536


@pytest.mark.cuda
def test_sleep_frees_device_memory_and_wake_up_gives_hf_tokens_through_the_graphs(llama_dir):
    from raylm.engine import LLM, SamplingParams

    llm = LLM(model=str(llama_dir), dtype="float32", max_num_seqs=2, max_model_len=128, enable_sleep_mode=True,
              num_gpu_blocks_override=NUM_BLOCKS)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = [hf_greedy(llama_dir, prompt, MAX_TOKENS) for prompt in PROMPTS]

        def tokens() -> list[list[int]]:
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            return [output.outputs[0].token_ids for output in outputs]

        runner = llm.llm_engine.executor.driver_worker.model_runner
        assert runner.decode_graphs is not None
        assert tokens() == expected
        kv_bytes = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
        weight_bytes = sum(p.nbytes for p in runner.model.parameters())
        for level in (1, 2):
            torch.cuda.synchronize()
            reserved_awake = torch.cuda.memory_reserved()
            allocated_awake = torch.cuda.memory_allocated()
            llm.sleep(level=level)
            assert allocated_awake - torch.cuda.memory_allocated() >= kv_bytes + weight_bytes
            assert reserved_awake - torch.cuda.memory_reserved() >= kv_bytes  # handed back, not kept cached
            assert runner.decode_graphs is None
            if level == 2:
                llm.wake_up(tags=["weights"])
                llm.collective_rpc("reload_weights")
            llm.wake_up()
            assert runner.decode_graphs is not None  # captured again over the new addresses
            assert tokens() == expected
    finally:
        llm.shutdown()
