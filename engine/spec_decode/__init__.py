"""Speculative decoding on the driver: the configuration, the n-gram proposer, adaptive
draft lengths and the acceptance counters. The workers' side (the draft model, the
rejection sampler) lives in `raylm.executors`."""

from raylm.engine.spec_decode.config import SpeculativeConfig, build_speculative_config, parse_speculative_config
from raylm.engine.spec_decode.metrics import SpecDecodingStats

__all__ = ["SpeculativeConfig", "SpecDecodingStats", "build_speculative_config", "parse_speculative_config"]
