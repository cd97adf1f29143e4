"""Trained stopping heads: the models and their self-describing file format.

A head file is one safetensors file whose metadata carries the head's config
and the fingerprint of the draft model it was trained for, so loading can
refuse a head that does not fit the running draft.
"""

from vllm_adaptive_spec.heads.fileformat import HeadFile, load_head_file, model_fingerprint, save_head_file
from vllm_adaptive_spec.heads.specdecpp import SpecDecHead, SpecDecHeadConfig, stop_rule

__all__ = [
    "HeadFile",
    "SpecDecHead",
    "SpecDecHeadConfig",
    "load_head_file",
    "model_fingerprint",
    "save_head_file",
    "stop_rule",
]
