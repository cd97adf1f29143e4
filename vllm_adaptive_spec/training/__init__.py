"""Training pipelines for the stopping heads (host-free: no vLLM here).

`data` turns target responses into teacher-forced draft/target passes,
acceptance labels and draft hidden states (reusable by the Pacer
pre-verifier); `specdecpp` trains and evaluates the SpecDec++ head. Target
responses themselves come from vLLM: `vllm_adaptive_spec.integration.datagen`.
"""
