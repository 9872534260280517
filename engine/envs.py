"""Every `RAYLM_*` environment variable raylm reads, in one place: its type, default, the
values it allows and what it does (the model is vLLM's `envs.py`).

    from raylm.engine import envs
    if envs.RAYLM_CPU_BIND: ...

A variable is read and parsed when its attribute is asked for, as vLLM reads its own, so a
value set inside the process (a test's monkeypatch, a Ray worker's runtime environment)
counts; each reader asks when it decides, most of them once per process. Unset or empty
means the default. A value the variable does not allow is a ValueError naming the variable,
the value and what is allowed; `check_all()` raises it for every variable at engine start,
before a model or kernel is loaded.

Settings of the engine and of the server are engine arguments and flags, not variables; the
variables here are what must be known before those exist (which instruction set the kernels
are compiled for, a limit checked while a request is parsed) or what belongs to the machine
(memory, core binding).

`RAYLM_TEST_DISABLE_KERNELS` is private: tests (and developers comparing) turn off a
kernel path with it, one name of `TEST_KERNEL_SWITCHES` or several, comma-separated. It is
not on the documentation page and may change without notice.

docs/environment_variables.md is generated from this module (`markdown()`) by
`python scripts/generate_docs.py`.

kernels/ and parallel/ read this module, so it imports only the standard library.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The server's API key variable: deploy/server_args.py names it in its flags' help.
API_KEY_VARIABLE = "RAYLM_API_KEY"

# RAYLM_CPU_ISA's choices; kernels/native_build.py holds the compiler flags of each.
CPU_ISAS = ("avx512", "avx512_no_bf16", "avx2", "scalar")

# The kernel paths RAYLM_TEST_DISABLE_KERNELS can turn off, each with what runs instead.
TEST_KERNEL_SWITCHES = {
    "fused_ops": "the fused CPU ops (kernels/cpu_ops.py): PyTorch's ops run",
    "fused_decode": "the one-call CPU decode step (kernels/cpu_fused_decode.py): the modules run",
    "packed_linear": "every packed CPU GEMM (kernels/cpu_gemm.py): every linear layer calls F.linear",
    "amx_linear": "the AMX decode GEMM only (kernels/cpu_gemm.py)",
    "avx512_linear": "the AVX-512 decode GEMM only (kernels/cpu_gemm.py)",
    "avx2_linear": "the AVX2 decode GEMM only (kernels/cpu_gemm.py)",
    "silu_and_mul_linear": ("the gate_up GEMMs with SiLU-and-mul in their epilogue (kernels/cpu_gemm.py): the "
                            "streaming kernel, then silu_and_mul"),
    "shm_comm": "the shared-memory tensor-parallel collectives (parallel/shm_communicator.py): gloo",
    "lora_kernel": "the native CPU LoRA kernel (kernels/lora_ops.py): the batched masked GEMMs",
    "triton_elementwise": "the fused Triton pointwise ops on CUDA (kernels/triton_elementwise.py): PyTorch's ops run",
    "fp8_linear": "the native FP8 decode GEMM (kernels/fp8_linear.py): weights dequantized in chunks, then F.linear",
    "int4_linear": "the native CPU GPTQ/AWQ GEMM (kernels/int4_linear.py): codes dequantized in column chunks",
    "int4_experts": ("the native CPU dequantization of GPTQ/AWQ MoE experts (kernels/int4_fused_moe.py): "
                     "PyTorch's"),
}


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: `parse` turns its text into the value, raising ValueError
    for text outside `allowed` (a phrase that completes "must be ...")."""

    name: str
    type_name: str
    default: Any
    default_text: str
    allowed: str
    doc: str
    parse: Callable[[str], Any]
    public: bool = True

    def value(self) -> Any:
        text = os.environ.get(self.name, "").strip()
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError:
            raise ValueError(f"{self.name} must be {self.allowed}, got {text!r}.") from None


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(text)
    return text == "1"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(text)
        return text
    return parse


def _kernel_names(text: str) -> frozenset[str]:
    names = frozenset(name.strip() for name in text.split(",") if name.strip())
    if not names <= TEST_KERNEL_SWITCHES.keys():
        raise ValueError(text)
    return names


def _flag_var(name: str, default: bool, doc: str) -> EnvVar:
    return EnvVar(name, "bool", default, "1" if default else "0", "0 or 1", doc, _flag)


_VARIABLES = [
    EnvVar("RAYLM_CPU_ISA", "str", None, "unset: -march=native as it is",
           f"one of {', '.join(CPU_ISAS)}",
           "Compiles the native CPU kernels for a narrower instruction set than this CPU's, so that "
           "one machine can build and test the code another CPU runs: `avx512` (the default where the "
           "CPU has AVX-512), `avx512_no_bf16` (AVX-512 without AVX512-BF16 or AMX), `avx2` (AVX2 and "
           "FMA), `scalar` (the portable loops). Each choice is a separate build in the cache "
           "(`~/.cache/raylm`); one this CPU cannot run is refused.",
           _one_of(CPU_ISAS)),
    EnvVar("RAYLM_MAX_N_SEQUENCES", "int", 16384, "16384", "an integer of at least 1",
           "The most samples one request may ask for (`n` and `best_of`; on the server also prompts "
           "x `best_of`), vLLM's limit. Each sample is a request of its own inside the engine. Read "
           "once, when raylm is imported.",
           _positive_int),
    _flag_var("RAYLM_CPU_BIND", True,
              "CPU tensor parallelism: binds each rank's threads to its own share of the machine's cores "
              "(contiguous, disjoint, as vLLM's CPU workers bind theirs). 0 leaves placement to the "
              "operating system: for a machine shared with other servers or jobs."),
    _flag_var("RAYLM_CPU_HUGE_PAGES", True,
              "Puts the packed weight copies of the streaming decode GEMMs and the KV cache on 2 MiB "
              "transparent huge pages where the kernel allows it (fewer TLB misses in a decode step). 0 "
              "keeps ordinary pages: a huge page may have to be assembled (compacted) when memory is "
              "fragmented, which slows loading on a crowded machine. Read by the native kernels at each "
              "allocation."),
    _flag_var("RAYLM_CPU_MALLOC_TUNING", True,
              "CPU workers set glibc's malloc to keep freed memory for the next step (one arena, "
              "allocations up to 32 MiB from the heap, no trimming below 1 GiB free), so a prefill step "
              "does not page-fault its activations in again; the process then keeps its peak working "
              "set. 0 keeps glibc's defaults. Skipped anyway where a MALLOC_* variable is set or an "
              "allocator (tcmalloc, jemalloc, mimalloc) is preloaded."),
    _flag_var("RAYLM_SERVER_DEV_MODE", False,
              "`raylm serve` adds its development routes (vLLM's VLLM_SERVER_DEV_MODE): `POST /sleep?level=`, "
              "`POST /wake_up?tags=`, `GET /is_sleeping`, `POST /reset_prefix_cache` and `POST /collective_rpc`, "
              "behind the server's API key like every route. For RLHF trainers that drive the server; never expose "
              "them to users. Read when the app is built."),
    _flag_var("RAYLM_TRACEBACK", False,
              "`raylm` commands print a user error (a bad argument, a model that cannot be loaded) as "
              "one line; 1 shows the traceback instead."),
    EnvVar(API_KEY_VARIABLE, "str", None, "unset: no key, unless --api-key or --api-key-file gives one",
           "any text",
           "The API key `raylm serve` requires (as vLLM reads VLLM_API_KEY): clients send it as "
           "`Authorization: Bearer KEY`. Unlike `--api-key`, it does not show in `ps`. `--api-key` and "
           "`--api-key-file` take precedence.",
           str),
    EnvVar("RAYLM_TEST_DISABLE_KERNELS", "list of str", frozenset(), "unset: every kernel path on",
           f"a comma-separated list of {', '.join(TEST_KERNEL_SWITCHES)}",
           "Private, for tests and comparisons: turns off the named kernel paths (TEST_KERNEL_SWITCHES).",
           _kernel_names, public=False),
]
VARIABLES: dict[str, EnvVar] = {variable.name: variable for variable in _VARIABLES}


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return VARIABLES[name].value()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


def check_all() -> None:
    """Parses every variable: a ValueError for the first whose value is not allowed."""
    for variable in VARIABLES.values():
        variable.value()


def kernel_switched_off(kernel: str) -> bool:
    """Whether RAYLM_TEST_DISABLE_KERNELS turns off `kernel`, one of TEST_KERNEL_SWITCHES."""
    assert kernel in TEST_KERNEL_SWITCHES, kernel
    return kernel in VARIABLES["RAYLM_TEST_DISABLE_KERNELS"].value()


def switch_off_kernels(kernels: frozenset[str] | set[str]) -> None:
    """Sets RAYLM_TEST_DISABLE_KERNELS in this process to `kernels` (each one of
    TEST_KERNEL_SWITCHES; empty clears it): a benchmark's A/B runs in one process."""
    unknown = set(kernels) - set(TEST_KERNEL_SWITCHES)
    assert not unknown, unknown
    name = VARIABLES["RAYLM_TEST_DISABLE_KERNELS"].name
    if kernels:
        os.environ[name] = ",".join(sorted(kernels))
    else:
        os.environ.pop(name, None)


def markdown() -> str:
    """docs/environment_variables.md: the public variables, from their definitions above."""
    lines = ["# Environment variables", "",
             "<!-- Generated from engine/envs.py by `python scripts/generate_docs.py`: edit the definitions",
             "     there, then regenerate. -->", "",
             "raylm reads these variables when it starts (each reader once, when it decides). Unset or empty "
             "means the default; a value outside the allowed ones stops the engine at start with an error "
             "naming the variable. Engine and server settings are engine arguments (`LLM(...)`, the flags "
             "of `raylm serve`), not variables.", ""]
    for variable in VARIABLES.values():
        if not variable.public:
            continue
        lines += [f"## `{variable.name}`", "",
                  f"- type: {variable.type_name}",
                  f"- default: {variable.default_text}",
                  f"- allowed: {variable.allowed}", "",
                  variable.doc, ""]
    private = [name for name, variable in VARIABLES.items() if not variable.public]
    lines += [f"raylm's tests also read {', '.join(f'`{name}`' for name in private)} (engine/envs.py), which is "
              "not a stable interface.", ""]
    return "\n".join(lines)
