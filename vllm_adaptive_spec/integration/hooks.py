"""Every place where the plugin touches vLLM, in install order, with its reason.

Each hook wraps one vLLM method and calls the original first (except the
`_model_forward` hook, whose work for policy `pearl` must start just before
the target's forward). For an engine whose `additional_config` has no
`adaptive_spec` key a hook does nothing else, so vLLM behaves exactly as
without the plugin.

For engines with `adaptive_spec` the second hook calls `runtime.activate`,
which does the only other two things the plugin changes, in this order:
1. `fixes.apply_cpu_sampling_fix`: on CPU with vLLM 0.32.0, rebinds
   `vllm.v1.sample.rejection_sampler.expand_batch_to_tokens` (vLLM issue
   55005: its CPU fallback returns uninitialised values);
2. replaces the runner's `drafter` with the adaptive drafter for its method
   (`proposer.DRAFTERS`): vLLM's own proposer class (`DraftModelProposer`,
   `EagleProposer`, `DFlashProposer`) with the shared adaptive draft loop in
   front of it.
With policy `pearl` the adaptive drafter is `pearl.PearlProposer`, and the
`_model_forward` hook (the last in `HOOKS`) starts its draft thread just
before each target forward; with `time_policy` it also times that forward
(the clock's steady rounds); for every other engine it does nothing.
Separately, `prometheus.AdaptiveSpecStatLogger` is a stat-logger plugin (a
vLLM extension point, not a patch) that exports nothing for other engines.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_adaptive_spec.config import CONFIG_KEY, AdaptiveSpecConfig, ConfigError, parse_additional_config
from vllm_adaptive_spec.policies import POLICY_CLASSES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hook:
    module: str  # where the owner class lives
    owner: str  # class name
    attr: str  # method wrapped
    reason: str
    wrap: Callable[[Callable], Callable]


# speculative_config.method values the adaptive loop serves (proposer.DRAFTERS has one drafter each)
SUPPORTED_METHODS = ("draft_model", "eagle", "eagle3", "mtp", "dflash")
# drafters whose whole block comes from one forward: a policy's cut saves verification, not drafting,
# so the batch gate (which weighs the next draft step's cost) has nothing to decide there
PARALLEL_METHODS = ("dflash",)


# vLLM switches that take a path the adaptive loop does not read; refused rather than silently ignored
_UNSERVED_SPEC_FIELDS = {
    # the runner then hands the drafter the verification outcome through prepare_next_token_ids_cpu and
    # prepare_inputs, which the loop does not hook: drafts would stay lossless but every policy's
    # feedback and the plugin's counts would read "nothing verified"
    "disable_padded_drafter_batch": "the adaptive loop reads each round's verification outcome from "
    "vLLM's padded drafter batch",
    # the policies read the draft's whole distribution; a local argmax never gathers it
    "use_local_argmax_reduction": "stopping policies read the draft's full distribution, which a local "
    "argmax never gathers",
}


def _mtp_refusal(spec: Any) -> str | None:
    """Why the plugin cannot serve this MTP drafter, or None. vLLM runs most MTP layers through its
    EagleProposer (the loop in front of it is ours); these take a proposer or a draft step of their own."""
    model_type = getattr(spec.draft_model_config.hf_config, "model_type", None)
    if spec.use_gemma4_mtp() or spec.use_step3p5_mtp():
        return f"MTP model_type {model_type!r} drafts through a proposer class of its own in vLLM"
    if getattr(spec.draft_model_config.hf_config, "index_share_for_mtp_iteration", False):
        return f"MTP model_type {model_type!r} shares its sparse-attention indices across draft steps"
    return None


def check_engine_config(vllm_config: Any) -> AdaptiveSpecConfig | None:
    """Validate the plugin's config against the engine's; None when the plugin is off."""
    cfg = parse_additional_config(vllm_config.additional_config)
    if cfg is None:
        return None
    spec = vllm_config.speculative_config
    method = None if spec is None else spec.method
    if method not in SUPPORTED_METHODS:
        raise ConfigError(
            f"adaptive_spec needs speculative_config with a method in {list(SUPPORTED_METHODS)} "
            f"(its num_speculative_tokens is the cap K); got speculative_config.method={method!r}"
        )
    why = _mtp_refusal(spec) if method == "mtp" else None
    if why is not None:
        raise ConfigError(f"adaptive_spec does not support this speculative_config.method='mtp' drafter yet: {why}")
    for field, why in _UNSERVED_SPEC_FIELDS.items():
        if getattr(spec, field, False):
            raise ConfigError(f"adaptive_spec needs speculative_config.{field}=False (got True): {why}")
    if method in PARALLEL_METHODS:
        cfg = _off_here(
            vllm_config,
            cfg,
            "batch_aware",
            f"adaptive_spec.batch_aware: true does not combine with speculative_config.method={method!r} "
            "(the block is drafted in one forward, so there is no next draft step to weigh)",
        )
        cfg = _off_here(
            vllm_config,
            cfg,
            "tail_gate",
            f"adaptive_spec.tail_gate: true does not combine with speculative_config.method={method!r} "
            "(it cuts the tail on the batch gate's costs, and the batch gate is off for a block drafted in one "
            "forward)",
        )
        if cfg.compact_drafts:
            raise ConfigError(
                f"adaptive_spec.compact_drafts: true does not combine with speculative_config.method={method!r} "
                "(the block is drafted in one forward, so there is no later draft forward to compact)"
            )
        why = f"speculative_config.method={method!r} drafts its block in one forward: no draft step to save"
    elif parser := getattr(getattr(vllm_config, "structured_outputs_config", None), "reasoning_parser", None):
        why = f"with a reasoning parser ({parser!r}) the grammar starts where reasoning ends"
    else:
        why = None
    for field in ("grammar_mask", "grammar_stop") if why is not None else ():
        cfg = _off_here(
            vllm_config, cfg, field, f"adaptive_spec.{field}: true does not combine with this engine: {why}"
        )
    if cfg.skip_first_pass and method != "draft_model":
        raise ConfigError(
            f"adaptive_spec.skip_first_pass: true needs speculative_config.method='draft_model', got {method!r} "
            "(this drafter's first pass reads the target's hidden states, which a skipped round does not keep)"
        )
    for field in ("min_drafts", "context_tail"):
        value = getattr(cfg, field)
        if value and value > spec.num_speculative_tokens:
            raise ConfigError(
                f"adaptive_spec.{field}: {value} is above speculative_config.num_speculative_tokens "
                f"(the cap K, {spec.num_speculative_tokens})"
            )
    if cfg.policy == "pearl":
        if method != "draft_model":
            raise ConfigError(
                f"adaptive_spec.policy='pearl' needs speculative_config.method='draft_model', got {method!r} "
                "(a head that reads the target's hidden states cannot draft before the target has run)"
            )
        if vllm_config.scheduler_config.max_num_seqs != 1:
            raise ConfigError(
                "adaptive_spec.policy='pearl' serves one request at a time: set max_num_seqs=1 "
                f"(got max_num_seqs={vllm_config.scheduler_config.max_num_seqs})"
            )
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise ConfigError(
                "adaptive_spec.policy='pearl' runs one draft worker beside one engine process: "
                f"tensor_parallel_size={parallel.tensor_parallel_size} and "
                f"pipeline_parallel_size={parallel.pipeline_parallel_size} are not supported (set both to 1)"
            )
    # Trained heads must fit the running draft (SpecDec++: fingerprint in the head file).
    POLICY_CLASSES[cfg.policy].check_engine(cfg.params, spec.model)
    return cfg


def _off_here(vllm_config: Any, cfg: AdaptiveSpecConfig, field: str, refusal: str) -> AdaptiveSpecConfig:
    """A field that is on by default for adaptive policies and cannot work on this engine: off, or a
    start-up error when the user asked for it."""
    if not getattr(cfg, field):
        return cfg
    if vllm_config.additional_config[CONFIG_KEY].get(field) is True:
        raise ConfigError(refusal)
    return dataclasses.replace(cfg, **{field: False})


def _validate_at_engine_creation(original: Callable) -> Callable:
    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        vllm_config = original(self, *args, **kwargs)
        cfg = check_engine_config(vllm_config)
        if cfg is not None:
            logger.info(
                "vllm-adaptive-spec: policy=%s %s, cap K=%d",
                cfg.policy,
                cfg.params,
                vllm_config.speculative_config.num_speculative_tokens,
            )
            if vllm_config.use_v2_model_runner:
                # The adaptive proposer plugs into the V1 model runner; the
                # engine-core and worker processes started next inherit this.
                os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
                logger.info("vllm-adaptive-spec: using the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
            if vllm_config.scheduler_config.async_scheduling:
                # Async scheduling reserves K draft slots per request before the
                # drafts exist; per-request lengths cannot reach it.
                vllm_config.scheduler_config.async_scheduling = False
                logger.info("vllm-adaptive-spec: async scheduling turned off (drafts vary in length)")
        return vllm_config

    return create_engine_config


def _activate_in_model_runner(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        cfg = check_engine_config(vllm_config)
        if cfg is not None:
            from vllm_adaptive_spec.integration import runtime

            runtime.activate(self, cfg)

    return __init__


def _release_finished_requests(original: Callable) -> Callable:
    @functools.wraps(original)
    def _update_states(self, scheduler_output, *args, **kwargs):
        result = original(self, scheduler_output, *args, **kwargs)
        release = getattr(getattr(self, "drafter", None), "release_requests", None)  # only our proposer has it
        if release is not None:
            release(scheduler_output.finished_req_ids, scheduler_output.preempted_req_ids or ())
        return result

    return _update_states


def _around_target_forward(original: Callable) -> Callable:
    @functools.wraps(original)
    def _model_forward(self, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        start = getattr(drafter, "before_target_forward", None)  # only pearl's proposer
        if start is not None:
            start()
        timed = getattr(drafter, "timed_target_forward", None)  # only our proposers
        if timed is None:
            return original(self, *args, **kwargs)
        with timed():
            return original(self, *args, **kwargs)

    return _model_forward


HOOKS: tuple[Hook, ...] = (
    Hook(
        "vllm.engine.arg_utils",
        "EngineArgs",
        "create_engine_config",
        "validate adaptive_spec once, in the front-end process, so a bad value fails start-up "
        "with one clear error instead of a traceback from a worker",
        _validate_at_engine_creation,
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        "__init__",
        "switch the adaptive machinery on in the V1 model runner (the CPU runner subclasses it) "
        "of engines that ask for it",
        _activate_in_model_runner,
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        "_update_states",
        "drop a request's policy state and close its statistics in the engine step that ends or "
        "preempts it (vLLM hands the ids to the runner there, and nowhere the drafter sees them)",
        _release_finished_requests,
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        "_model_forward",
        "policy 'pearl': start drafting the next round on the draft thread just before the target's "
        "forward (its inputs are final there), so that the two run at the same time; with "
        "time_policy, time the target's forward (the clock's steady rounds)",
        _around_target_forward,
    ),
)

_MARK = "__vllm_adaptive_spec_hook__"


def install() -> None:
    import importlib

    for hook in HOOKS:
        owner = getattr(importlib.import_module(hook.module), hook.owner)
        original = getattr(owner, hook.attr)
        if getattr(original, _MARK, False):
            continue  # already installed in this process
        wrapped = hook.wrap(original)
        setattr(wrapped, _MARK, True)
        setattr(owner, hook.attr, wrapped)
