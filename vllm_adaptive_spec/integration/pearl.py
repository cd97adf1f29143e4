"""PEARL inside vLLM (policy `pearl`): the draft drafts while the target verifies.

One engine step, batch 1 (the only batch `pearl` accepts):
1. `before_target_forward` (hooks.py wraps the runner's `_model_forward`):
   the tokens the target is about to run (the request's context plus this
   step's input: the last token and the drafts it verifies) go to the draft
   worker, which drafts after them as if every draft were accepted
   (post-verify), token after token until step 3 asks, at most K + 1: the
   draft length follows how long the target takes (PEARL's gamma ~ c).
2. The target verifies and samples in the engine's thread, as always.
3. `propose` (the runner's draft call) collects the worker's tokens e_1..e_m.
   If every draft was accepted and the target's own next token equals e_1,
   the next step verifies e_2..e_m (the round stays in post-verify);
   otherwise (pre-verify) the worker first drafts `pre_draft` tokens after
   the corrected sequence while the engine waits (default 1), and the next
   step verifies them; with `pre_draft: 0` (PEARL's own pre-verify) the next
   step verifies no draft: the target computes its own next token while the
   worker drafts from the corrected sequence, and that token checks the
   worker's first draft. No draft forward runs in the engine's thread.

The worker (on CPU a process of its own on a CPU the engine does not use; on
GPU a thread with its own CUDA stream) runs the draft with PyTorch ops and its
own dense cache (`parallel_draft.py` says why); vLLM's draft model is loaded
but idle.
Drafts are greedy and carry no probabilities, so vLLM's rejection sampler
treats them as it treats every draft without probabilities: lossless for
greedy and sampled requests alike.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

from vllm_adaptive_spec.config import ConfigError
from vllm_adaptive_spec.integration.proposer import AdaptiveDraftModelProposer
from vllm_adaptive_spec.parallel_draft import DenseDraft, DraftProcess, DraftThread, free_cpus

logger = logging.getLogger(__name__)


class PearlProposer(AdaptiveDraftModelProposer):
    """method "draft_model" with policy "pearl": drafts come from the draft worker."""

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any, cfg: Any):
        super().__init__(vllm_config, device, runner, cfg)
        self.prepare_ahead = self.compact_drafts = False  # its draft runs on the worker, not in the step loop
        spec = vllm_config.speculative_config
        self.max_len = vllm_config.model_config.max_model_len
        dtype = spec.draft_model_config.dtype
        cpus = None
        if device.type == "cpu":
            busy = os.sched_getaffinity(0)  # this thread: the engine's OpenMP threads (vLLM binds them)
            cpus = {self.policy.draft_cpu} if self.policy.draft_cpu is not None else free_cpus(busy)
            if not cpus:
                logger.warning(
                    "vllm-adaptive-spec: pearl found no CPU outside the engine's %s; the draft shares "
                    "them (set VLLM_CPU_OMP_THREADS_BIND or adaptive_spec.draft_cpu)",
                    sorted(busy),
                )
                cpus = None
        worker = self.policy.draft_worker or ("process" if device.type == "cpu" else "thread")
        if worker == "process" and device.type != "cpu":
            raise ConfigError(f"adaptive_spec.draft_worker: 'process' runs on CPU only, this engine runs on {device}")
        if worker == "process":
            self.drafts = DraftProcess(spec.model, self.max_len, dtype, cpus)
        else:
            self.drafts = DraftThread(DenseDraft.load(spec.model, self.max_len, device, dtype), cpus, device)
        self._step: tuple[str, np.ndarray] | None = None  # (request, the sequence the target runs) of the job
        self._last_req: str | None = None  # the request of the previous step
        logger.info("vllm-adaptive-spec: pearl drafts in a %s on CPUs %s", worker, self.drafts.thread_cpus)

    def before_target_forward(self) -> None:
        """Hand the draft worker the sequence the target is about to run (one request decoding)."""
        ib = self.runner.input_batch
        if ib.num_reqs != 1:
            return
        end = int(ib.num_computed_tokens_cpu[0]) + int(self.runner.query_start_loc.np[1])
        if end < int(ib.num_prompt_tokens[0]):
            return  # a prefill chunk that samples nothing
        n = min(self.num_speculative_tokens + 1, self.max_len - end + 1)  # the draft's cache ends at max_model_len
        seq = ib.token_ids_cpu[0, :end].copy()
        try:
            self.drafts.submit(seq, n)
        except Exception:  # e.g. the draft process is gone: this step runs without a job, never fails
            logger.exception("vllm-adaptive-spec: pearl could not start a draft job; this step has none")
            return
        self._step = (ib.req_ids[0], seq)

    def _propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,  # [B]
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: Any,
        sampling_metadata: Any,
        *args: Any,
        **kwargs: Any,
    ) -> list[list[int]]:
        self._last_draft_probs = None
        batch = common_attn_metadata.batch_size()
        req_ids = list(self.runner.input_batch.req_ids[:batch])
        generated = self._end_of_verification(req_ids)
        drafted = self._verified_drafts or [0] * batch
        same = batch == 1 and req_ids[0] == self._last_req
        self._last_req = req_ids[0] if batch == 1 else None
        try:
            ahead = self.drafts.collect(same)  # e_1..e_m (m <= K + 1), or None when no job ran this step
        except Exception:  # a failed draft job costs this step its drafts, never the request
            logger.exception("vllm-adaptive-spec: pearl's draft job failed; this step goes on without drafts")
            ahead = None
        step, self._step = self._step, None
        if batch != 1 or ahead is None or step is None or step[0] != req_ids[0]:
            self.stats.record_proposal([0] * batch, 0, req_ids, [0] * batch)
            return [[] for _ in range(batch)]
        limit = self._round_limits(
            req_ids, self._rooms(req_ids, generated, num_speculative_tokens), num_speculative_tokens
        )[0]
        bonus = int(next_token_ids[0])
        all_accepted = generated[0] == drafted[0] + 1
        if all_accepted and bonus == ahead[0]:
            draft, drawn = ahead[1 : 1 + limit], len(ahead)
        else:
            draft, drawn = self._pre_draft(step[1], drafted[0], generated[0] - 1, bonus, limit), len(ahead)
            drawn += len(draft)
        self.stats.record_proposal([len(draft)], 0, req_ids, [drawn])
        return [draft]

    def _pre_draft(self, seq: np.ndarray, drafted: int, accepted: int, bonus: int, limit: int) -> list[int]:
        """After a rejection: `pre_draft` drafts after the corrected sequence, made now (0: none)."""
        n = min(self.policy.pre_draft, limit)
        if n == 0:
            return []
        corrected = np.append(seq[: len(seq) - drafted + accepted], bonus).astype(np.int32)  # [L']
        try:
            self.drafts.submit(corrected, n, until_asked=False)
            made = (self.drafts.collect(step=False) or [])[:n]
            self.drafts.timeline.pre_drafted += len(made)
            return made
        except Exception:
            logger.exception("vllm-adaptive-spec: pearl's pre-draft failed; this step goes on without drafts")
            return []

    def parallel_stats(self) -> dict:
        cpus = self.drafts.thread_cpus
        return self.drafts.timeline.as_dict() | {"draft_cpus": sorted(cpus) if cpus else None}
