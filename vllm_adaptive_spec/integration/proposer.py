"""The adaptive draft loop: vLLM's drafters with per-request stopping.

One loop (`AdaptiveDraftLoop`) serves every drafter the plugin supports; a
drafter is a two-line adapter that puts the loop in front of vLLM's own
proposer class (`AdaptiveDraftModelProposer` for an independent draft model,
`AdaptiveEagleProposer` for EAGLE / EAGLE-3 heads and MTP layers, `AdaptiveDFlashProposer`
for DFlash block drafters). What differs per drafter
stays vLLM's: the first pass's inputs (`set_inputs_first_pass`, the EAGLE-3
fused target features), whether the model reads a hidden state
(`pass_hidden_states_to_model`) and whether it returns a separate state to
carry into the next step (`model_returns_tuple`).

Each round the drafter first reads the newly verified tokens (vLLM's
first pass, unchanged), then drafts one token per step for the whole batch.
After every step the policy decides, per request, whether the new token is
kept and whether drafting stops; the loop ends once no request is drafting,
and each request's draft reaches the scheduler cut to its own length. KV
cache, attention metadata and sampling all go through the vLLM helpers the
base proposer uses; only the loop and its stopping are ours.

Rows that stopped stay in the batch until the loop ends (their extra tokens
are computed and dropped), unless `compact_drafts` is on: then, once the rows
still drafting are at most half of those a forward computed, the next forwards
run on those rows only (`_Rows`: the attention metadata, positions, tokens and
carried state cut to them); their outputs are written back into full-batch
tensors, so the policy, the gate and the bookkeeping see the batch as before.

A parallel drafter (DFlash) drafts its whole block in the first pass: step t
reads the block's position t instead of running a forward, and the same
policy cuts each request's block where it stops. The cut saves verification
(fewer draft tokens for the target to check), never draft compute; every
position's distribution exists before any token is drawn, so a cut depends
only on what was known before the dropped drafts were drawn.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch
from vllm.distributed.parallel_state import get_tp_group
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_adaptive_spec.config import AdaptiveSpecConfig, ConfigError
from vllm_adaptive_spec.integration.grammar import GrammarStops
from vllm_adaptive_spec.policies import StopPolicy
from vllm_adaptive_spec.policies.batch_gate import draft_top
from vllm_adaptive_spec.policies.step import decisions_to_host, policy_logprobs, rows_to_compute
from vllm_adaptive_spec.policies.tail import ContextTail, TailGate, with_tail_probs
from vllm_adaptive_spec.policies.timing import Clock, TimedPolicy
from vllm_adaptive_spec.stats import StatsBook

logger = logging.getLogger(__name__)


class AdaptiveDraftLoop:
    """The shared loop; mixed in front of a vLLM `SpecDecodeBaseProposer` subclass."""

    skips_first_pass = False  # its first pass re-reads every verified token (a draft model; see __init__)

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any, cfg: AdaptiveSpecConfig):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        unsupported = {
            "M-RoPE draft": self.uses_mrope,
            "multimodal draft": self.supports_mm_inputs,
            "heterogeneous vocabularies": getattr(self, "use_heterogeneous_vocab", False),
            "constant draft positions": getattr(self, "constant_draft_positions", False),
        }
        for what, present in unsupported.items():
            if present:
                raise ConfigError(f"adaptive_spec.policy={cfg.policy!r} does not support {what} yet")
        self.runner = runner
        # Ranks see the same gathered logits, so they decide alike; with tensor
        # parallelism rank 0's decision is broadcast anyway, so a rounding
        # difference can never make ranks run different numbers of forwards.
        self._tp_group = get_tp_group() if vllm_config.parallel_config.tensor_parallel_size > 1 else None
        self.policy: StopPolicy = cfg.build_policy()
        self.policy.device = device
        self.stats = StatsBook()
        self.gate = cfg.build_gate()  # batch-aware stopping beside the policy, or None
        # structured outputs: a row stops at its first draft token the grammar refuses and, with
        # grammar_mask, draws only what it allows (hooks: off for block drafters, whose one forward
        # drafts the block)
        self.grammar = GrammarStops(vllm_config, masks=cfg.grammar_mask) if cfg.grammar_stop else None
        self._sampled: torch.Tensor | None = None  # [B, K+1] this step's tokens (the first valid_counts[i])
        # Prepare step t+1's inputs before waiting for step t's decisions (see _draft_step_inputs): on an
        # asynchronous device that host work overlaps step t's kernels; on CPU it only adds a wasted
        # preparation to every round that a stop ends, so by default only on CUDA.
        self.prepare_ahead = device.type == "cuda" if cfg.prepare_ahead is None else cfg.prepare_ahead
        # Later draft forwards run on the rows still drafting once they are at most half of the batch. On
        # CPU it cut the draft side by up to a quarter where a per-request rule left rows idle (draft models
        # at 32 rows; within noise on the toy EAGLE-3 head: benchmarks/results/compact_ab_*); on an H100 at
        # 8B sizes a draft forward costs about the same at any row count (0.60 to 0.70 ms), so CPU only.
        # (A block drafter drafts in one forward: nothing to compact; hooks refuse an explicit true.)
        compact = device.type != "cuda" if cfg.compact_drafts is None else cfg.compact_drafts
        self.compact_drafts = compact and not self.parallel_drafting
        self.min_drafts = cfg.min_drafts  # no row's draft ends below this (its limit allowing)
        # free tokens the context predicts, after the drafts (policies/tail.py); per request given a tail
        # last round, the drafter's drafts before it (the policy and the gate learn from those only)
        self.tail = ContextTail(cfg.context_tail) if cfg.context_tail else None
        self._before_tail: dict[str, int] = {}
        # ... cut to what pays for its verification where the batch gate runs, on its curves (tail.py)
        self.tail_gate = TailGate(cfg.context_tail) if cfg.tail_gate and self.gate is not None else None
        if cfg.time_policy:
            self.stats.clock = Clock()
            self.stats.clock.watch_gc()
            self.policy = TimedPolicy(self.policy, self.stats.clock, self._sync if device.type == "cuda" else None)
        # A round the gate verifies nothing in (no draft, no tail) needs the draft's first pass only to
        # keep the draft's KV cache current; a draft model's next first pass re-reads the verified token
        # anyway, so it skips every other such round (_first_pass_skippable). 1/2: the share it skips.
        # (hooks.check_engine_config refuses an explicit true for other drafters)
        skip = self.skips_first_pass and cfg.skip_first_pass is not False and self.gate is not None
        self._skip_share = 0.5 if skip and not self.policy.observes_context else 0.0
        self._skipped: set[str] = set()  # requests whose last round skipped its first pass
        self._valid_counts: torch.Tensor | None = None  # [B] tokens each request generated this step
        self._verified_drafts: list[int] | None = None  # drafts each request had verified this step
        self._last_round: tuple[set[str], float] | None = None  # the last round's requests and its end time

    # -- feedback from verification (called by the runner before propose) --

    def prepare_next_token_ids_padded(self, sampled_token_ids, *args, **kwargs):
        next_token_ids, valid_counts = super().prepare_next_token_ids_padded(sampled_token_ids, *args, **kwargs)
        self._valid_counts = valid_counts
        self._sampled = sampled_token_ids
        self._verified_drafts = None
        return next_token_ids, valid_counts

    def prepare_inputs_padded(self, common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count):
        self._verified_drafts = list(spec_decode_metadata.num_draft_tokens)
        return super().prepare_inputs_padded(common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count)

    def _end_of_verification(self, req_ids: list[str]) -> list[int]:
        """Feed last round's outcome to the policy and the stats; returns tokens generated per row."""
        batch = len(req_ids)
        generated = [1] * batch if self._valid_counts is None else self._valid_counts[:batch].tolist()
        drafted = self._verified_drafts or [0] * batch
        self.stats.record_verification(req_ids, drafted, generated)
        own = drafted  # the drafter's drafts, without last round's tails
        if self._before_tail:
            own = [min(n, self._before_tail.get(r, n)) for r, n in zip(req_ids, drafted)]
            self._before_tail.clear()
        if self.tail_gate is not None:  # what the target made of the drafter's drafts and the tails
            rows = [i for i, (n, g) in enumerate(zip(drafted, generated)) if n > 0 and g > 0]
            with self._timed():
                self.tail_gate.learn(
                    [own[i] for i in rows],
                    [drafted[i] - own[i] for i in rows],
                    [min(generated[i] - 1, drafted[i]) for i in rows],
                )
        drafted = own  # the policy and the gate see their drafter's drafts only
        decoding = [i for i, n in enumerate(generated) if n > 0 and drafted[i] > 0]
        outcome = (
            [req_ids[i] for i in decoding],
            [drafted[i] for i in decoding],
            [min(generated[i] - 1, drafted[i]) for i in decoding],
        )
        self.policy.end_round(*outcome)
        if self.gate is not None:
            with self._timed():
                self.gate.end_round(*outcome)
        return generated

    def release_requests(self, finished: Any, preempted: Any) -> None:
        """Called by the runner's state update (hooks.py): finished requests close
        their statistics; finished and preempted ones lose their policy state."""
        for req_id in finished:
            self.stats.finish(req_id)
        for req_id in [*finished, *preempted]:
            self._skipped.discard(req_id)
            self.policy.forget(req_id)
            if self.tail is not None:
                self.tail.forget(req_id)
            if self.gate is not None:
                self.gate.forget(req_id)
            if self.grammar is not None:
                self.grammar.forget(req_id)

    def _feed_tokens(self, readers: list[Any], req_ids: list[str], generated: list[int]) -> None:
        """Each reader of the requests' tokens (a policy that reads_tokens, the context tail) gets what each
        request gained since it last read: the runner's prompt and output (the output before this step)
        and this step's tokens (one host copy of them for all readers)."""
        if not readers:
            return
        host = self._sampled.tolist() if self._sampled is not None else None  # [B, K+1]
        states = [self.runner.requests.get(req_id) for req_id in req_ids]
        for reader in readers:
            new: list[list[int]] = []
            for i, (req_id, state) in enumerate(zip(req_ids, states)):
                if state is None:
                    new.append([])
                    continue
                prompt, output = state.prompt_token_ids or [], state.output_token_ids
                seen = reader.tokens_seen(req_id)
                head = [*prompt[seen:], *output] if seen < len(prompt) else list(output[seen - len(prompt) :])
                new.append(head + (host[i][: generated[i]] if host is not None else []))
            reader.observe_tokens(req_ids, new)

    def _round_limits(self, req_ids: list[str], rooms: list[int], cap: int) -> list[int]:
        """Per request: the policy's length bound, never past its room (`_rooms`)."""
        return [min(n, room) for n, room in zip(self.policy.round_limits(req_ids, cap), rooms)]

    def _rooms(self, req_ids: list[str], generated: list[int], cap: int) -> list[int]:
        """Per request: the drafts it may have this round, the cap K short of max_tokens and the model length."""
        limits = [cap] * len(req_ids)
        num_tokens = self.runner.input_batch.num_tokens_no_spec
        for i, req_id in enumerate(req_ids):
            state = self.runner.requests.get(req_id)
            if state is None:
                continue
            # The runner records this step's `generated` tokens after drafting.
            room = self.max_model_len - int(num_tokens[i]) - generated[i] - 1
            max_tokens = getattr(state.sampling_params, "max_tokens", None)
            if max_tokens is not None:
                room = min(room, max_tokens - len(state.output_token_ids) - generated[i] - 1)
            limits[i] = max(0, min(limits[i], room))
        return limits

    # -- the draft loop --

    def _first_pass_features(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """What the drafter's first pass reads of the target (adapters override)."""
        return target_hidden_states

    def _forward(self, per_layer_md, num_input: int, mode, across_dp, slot_mapping, **model_inputs):
        """One draft forward -> (state the logits come from, state carried into the next step)."""
        with set_forward_context(
            per_layer_md,
            self.vllm_config,
            num_tokens=num_input,
            num_tokens_across_dp=across_dp,
            cudagraph_runtime_mode=mode,
            slot_mapping=slot_mapping,
        ):
            out = self.model(**model_inputs)
        return out if self.model_returns_tuple() else (out, out)

    def propose(self, *args, **kwargs) -> list[list[int]]:
        with self._clocked("propose_s"):
            return self._propose(*args, **kwargs)

    def _timed(self):
        """The batch gate's time counts as the policy's (time_policy): both are the plugin's overhead."""
        return self._clocked("policy_s")

    def timed_target_forward(self):
        """Around the target's forward (hooks.py): its time, for the clock's steady rounds."""
        return self._clocked("last_target_s", add=False)

    @contextlib.contextmanager
    def _clocked(self, field: str, add: bool = True):
        """With time_policy: the block's wall time added to the clock's `field` (or replacing it)."""
        clock = self.stats.clock
        if clock is None:
            yield
            return
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        took = time.perf_counter() - start
        setattr(clock, field, (getattr(clock, field) if add else 0.0) + took)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,  # [num_tokens]
        target_positions: torch.Tensor,  # [num_tokens]
        target_hidden_states: torch.Tensor,  # [num_tokens, hidden]
        next_token_ids: torch.Tensor,  # [B]
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: Any,
        sampling_metadata: Any,
        mm_embed_inputs: Any = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,  # [B]
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        cap = num_speculative_tokens
        self.num_speculative_tokens = cap
        self._last_draft_probs = None
        batch = common_attn_metadata.batch_size()
        req_ids = list(self.runner.input_batch.req_ids[:batch])
        generated = self._end_of_verification(req_ids)
        steady = self._meter_pass(req_ids, generated)
        steps_start: float | None = None  # when the draft steps after the first pass began (steady rounds)
        readers = [self.policy] if self.policy.reads_tokens else []
        self._feed_tokens(readers + ([self.tail] if self.tail is not None else []), req_ids, generated)
        rooms = self._rooms(req_ids, generated, cap)
        limits = self._round_limits(req_ids, rooms, cap)
        if self.tail is not None:  # a row whose context predicts its next token drafts one token, then its tail
            one = max(1, self.min_drafts)
            limits = [min(n, one) if self.tail.predicts(r) else n for r, n in zip(req_ids, limits)]
        gate = self.gate if batch >= self.policy.gate_min_rows else None
        quiet = False  # the round verifies nothing: no draft, no tail
        if gate is not None:
            with self._timed():
                drafting = sum(n > 0 for n in limits)
                none = self.min_drafts == 0 and gate.no_draft_round(batch, drafting, self._skip_share)
                if self._tp_group is not None:  # every rank takes rank 0's verdict (measured costs are its own)
                    none = bool(self._tp_group.broadcast(torch.tensor([int(none)], device=self.device), src=0).item())
                if none:  # no draft pays for this batch: the first pass only (it reads the verified tokens)
                    gate, limits = None, [0] * batch
                    quiet = self._skip_share > 0
                elif gate.one_step_round(batch):  # the gate's recent verdict: one step, no gate work
                    gate, limits = None, [min(n, max(1, self.min_drafts)) for n in limits]
        if quiet:
            rooms = [0] * batch  # ... and no tail: the next round's first pass can be skipped
            if self._first_pass_skippable(req_ids, generated, common_attn_metadata):
                self._skipped.update(req_ids)
                return self._no_drafts(req_ids, rooms, forwards=0)
        if self._skipped:
            self._skipped.difference_update(req_ids)

        # First pass: the draft reads the verified tokens; its last position per row drafts token 0.
        num_tokens, sample_idx, cad = self.set_inputs_first_pass(
            target_token_ids=target_token_ids,
            next_token_ids=next_token_ids,
            target_positions=target_positions,
            target_hidden_states=self._first_pass_features(target_hidden_states),
            token_indices_to_sample=token_indices_to_sample,
            cad=common_attn_metadata,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )
        _, per_layer_md = self.build_per_group_and_layer_attn_metadata(cad)
        mode, num_input, across_dp = self._determine_batch_execution_and_padding(num_tokens)
        model_inputs, slot_size = self.build_model_inputs_first_pass(num_tokens, num_input, None)
        hidden, carried = self._forward(
            per_layer_md,
            num_input,
            mode,
            across_dp,
            self._get_slot_mapping(slot_size, cad.slot_mapping),
            **model_inputs,
        )
        forwards = 1
        if self.policy.observes_context:
            self._observe_context(req_ids, hidden, cad, num_rejected_tokens_gpu)
        if cap == 0 or max(limits) == 0:
            return self._no_drafts(req_ids, rooms, forwards)

        # A parallel drafter (DFlash) drafted the whole block in the first pass: its step t reads
        # block position t, no forward; the loop and the policy's stops are the same.
        block = hidden[sample_idx].view(batch, cap, -1) if self.parallel_drafting else None  # [B, cap, hidden]
        # ... and its logits come from one LM-head pass over the whole block, as vLLM's own DFlash
        # proposer computes them (one pass reads the head's weights once, not once per position);
        # position-major, so step t reads a contiguous [B, V].
        block_logits = None
        if block is not None:
            flat = block.transpose(0, 1).reshape(cap * batch, -1)  # [cap * B, hidden]
            block_logits = self.model.compute_logits(flat).view(cap, batch, -1)  # [cap, B, V]
        if block is None:
            hidden = hidden[sample_idx]  # [B, hidden]
            carried = carried[sample_idx]  # [B, hidden]
            positions = self.positions[sample_idx]  # [B]
        else:
            hidden = block[:, 0]
        grammar = self.grammar
        if grammar is not None and not grammar.start_round(req_ids, self.runner.requests, self._sampled, generated):
            grammar = None  # no structured request with a compiled grammar in this round
        # Per-row bookkeeping lives on the host: one copy of the policy's decisions per step (the
        # sync that ending the loop early needs anyway) instead of a dozen tiny tensor ops.
        active = [n > 0 for n in limits]  # rows still drafting
        lengths = [0] * batch  # tokens kept
        drawn = [0] * batch  # tokens drawn while the row was drafting (kept or dropped)
        temperature = None if sampling_metadata.all_greedy else sampling_metadata.temperature
        greedy_draws = sampling_metadata.all_greedy or not self._enable_probabilistic_draft_probs
        if gate is not None:
            with self._timed():
                gate.start_round(req_ids, cap, compact=self.compact_drafts)
        tokens_per_step: list[torch.Tensor] = []  # each [B]
        probs_per_step: list[torch.Tensor] = []  # each [B, V], for probabilistic draft sampling

        launch = (mode, num_input, across_dp)  # how draft forwards run (decode shape from step 1 on)
        # (one row never shrinks: the loop ends when it stops)
        rows = _Rows(batch, hidden.device) if self.compact_drafts and block is None and batch > 1 else None
        ready = None  # the next step's inputs when they were prepared ahead
        # A block drafter's steps run no forward, so nothing waits on the decisions but the loop's exit:
        # with prepare_ahead, or for a policy that never stops a row (it trims after the loop, e.g.
        # vllm_av), the policy decides every position first and the host reads them once.
        deferred: list[tuple[torch.Tensor, torch.Tensor]] | None = (
            [] if block is not None and (self.prepare_ahead or self.policy.trims) else None
        )
        steps = max(limits)
        for t in range(cap):
            if t > 0 and block is not None:
                if (t >= steps) if deferred is not None else not any(active):
                    break
                hidden = block[:, t]
            elif t > 0:
                if not any(active):
                    break
                if ready is None:
                    positions, cad, launch, ready = self._draft_step_inputs(
                        t, tokens_per_step[-1], carried, positions, cad, launch, num_rejected_tokens_gpu, rows, active
                    )
                (mode, num_input, across_dp), (per_layer_md, model_inputs), ready = launch, ready, None
                hidden, carried = self._forward(
                    per_layer_md, num_input, mode, across_dp, self._get_slot_mapping(num_input), **model_inputs
                )
                n = batch if rows is None else rows.n  # the rows this forward computed
                hidden, carried = hidden[:n], carried[:n]
                forwards += 1
            if rows is not None and rows.index is not None:  # [n] rows computed -> the whole batch
                logits = rows.expand("logits", self.model.compute_logits(hidden))  # [B, V]
                hidden = rows.expand("hidden", hidden)  # [B, hidden]
                # a drafter without a separate state (a draft model) carries what it returns (_forward)
                carried = rows.expand("carried", carried) if self.model_returns_tuple() else hidden  # [B, hidden]
            elif block_logits is not None:
                logits = block_logits[t]  # [B, V]
            else:
                logits = self.model.compute_logits(hidden)  # [B, V]
            masking = grammar is not None and grammar.masks  # structured rows draw only what their grammar allows
            # A greedy draw on CPU masks only the rows whose argmax the grammar refuses; a sampled draw reads
            # the whole masked distribution, and on a GPU reading the argmax first would add a host sync.
            refused_only = masking and greedy_draws and logits.device.type == "cpu"
            if masking and not refused_only:
                grammar.mask(logits, active)
            if greedy_draws:
                # vLLM's greedy draw is an argmax of the logits. On CPU a bfloat16 argmax costs about
                # 3.5x a float32 one (370 against 105 us at [32, 6144]), and the policy reads float32
                # log-probabilities anyway: one exact cast serves both, and argmax keeps the first
                # maximum in either dtype, so the tokens are vLLM's.
                logits = logits.float()
                tokens, draft_probs = logits.argmax(dim=-1), None  # [B]
                if refused_only:  # the same tokens as masking every structured row
                    tokens = grammar.mask_refused(logits, tokens, active)
            else:
                tokens, draft_probs = self._sample_from_logits(logits, sampling_metadata)  # [B], [B, V] | None
            logp = policy_logprobs(logits, temperature)  # [B, V]
            decision = self.policy.decide(logp, tokens, t, hidden)
            top = None
            if gate is not None:
                with self._timed():
                    top = self.policy.gate_top(draft_top(logp, tokens, greedy=temperature is None))  # [B]
            tokens_per_step.append(tokens)
            if draft_probs is not None:
                probs_per_step.append(draft_probs)
            if deferred is not None:
                deferred.append((decision.keep, decision.stop))
                continue
            if self.prepare_ahead and block is None and any(a and n > t + 1 for a, n in zip(active, limits)):
                positions, cad, launch, ready = self._draft_step_inputs(
                    t + 1, tokens, carried, positions, cad, launch, num_rejected_tokens_gpu, rows, active
                )
            keeps, stops, tops, toks = decisions_to_host(
                decision.keep, decision.stop, top, None if grammar is None else tokens
            )
            if grammar is not None:  # a row stops after its first draft token the grammar refuses
                grammar.refuse(toks, active, keeps, stops)
            if t == 0 and steady:
                steps_start = time.perf_counter()  # the first pass is done; the draft steps start
            kept = _account(t, keeps, stops, limits, active, lengths, drawn, self.min_drafts)
            if gate is not None:  # ends the round for every row once another step does not pay
                with self._timed():
                    if not gate.after_step(tops, kept, active, lengths, t):
                        active = [a and n < self.min_drafts for a, n in zip(active, lengths)]
            if self._tp_group is not None:
                active, lengths = self._agree(active, lengths, hidden.device)

        if deferred:  # one host copy of every step's decisions [2, T, B], then the same bookkeeping
            decided = torch.stack([torch.stack(step) for step in deferred], dim=1).tolist()
            for t, (keeps, stops) in enumerate(zip(*decided)):
                _account(t, keeps, stops, limits, active, lengths, drawn, self.min_drafts)
            if self._tp_group is not None:
                active, lengths = self._agree(active, lengths, hidden.device)
        if gate is not None:
            with self._timed():
                gate.finish_round()
        if grammar is not None:
            grammar.end_round()
        if self.policy.trims:  # e.g. vllm_av: the whole round drafted, now choose what is verified
            admitted = self.policy.admit(torch.tensor(lengths, device=hidden.device))
            if self._tp_group is not None:
                admitted = self._tp_group.broadcast(admitted.clone(), src=0)
            lengths = admitted.tolist()
        if probs_per_step:
            self._last_draft_probs = torch.stack(probs_per_step, dim=1).contiguous()  # [B, T, V]
        drafts = torch.stack(tokens_per_step, dim=1).tolist()  # [B, T]; one host copy per round
        self.stats.record_proposal(lengths, forwards, req_ids, drawn, None if rows is None else rows.saved)
        # (a round whose later forwards computed fewer rows says nothing about a step of the whole batch)
        self._meter_round(req_ids, steps_start if rows is None or rows.index is None else None, forwards)
        return self._append_tail(req_ids, [row[:n] for row, n in zip(drafts, lengths)], rooms, forwards)

    def _no_drafts(self, req_ids: list[str], rooms: list[int], forwards: int) -> list[list[int]]:
        """A round that drafts nothing after its `forwards` draft forwards (0: the first pass skipped): each row
        gets only the tail its context predicts, room allowing."""
        self.stats.record_proposal([0] * len(req_ids), forwards)
        self._meter_round(req_ids, None, forwards)
        return self._append_tail(req_ids, [[] for _ in req_ids], rooms, forwards)

    def _first_pass_skippable(self, req_ids: list[str], generated: list[int], cad: Any) -> bool:
        """Whether this round's first pass may be skipped: the draft's KV cache already holds every token the
        target verified this round, and the next round's first pass reads the token sampled now (it reads
        the tokens the target verifies then, which start with it). So every row verified exactly one token
        (no draft, no prefill) that is an output token (a prompt token there may be one of a chunked prefill,
        whose first pass wrote a placeholder at its position), sampled one, and its last round ran the first
        pass that read that token."""
        batch = len(req_ids)
        qsl = cad.query_start_loc_cpu
        if int(qsl[batch]) - int(qsl[0]) != batch or any(g != 1 for g in generated):
            return False
        for req_id in req_ids:
            state = self.runner.requests.get(req_id)
            if req_id in self._skipped or state is None or not state.output_token_ids:
                return False
        return True

    def _append_tail(
        self, req_ids: list[str], drafts: list[list[int]], rooms: list[int], forwards: int
    ) -> list[list[int]]:
        """Each row's drafts followed by the tokens its context predicts after them (room allowing), cut
        to what pays for its verification where the batch gate runs, with one-hot draft probabilities
        where the round drew from distributions (policies/tail.py)."""
        if self.tail is None:
            return drafts
        extras = [self.tail.tail(r, row, room - len(row)) for r, row, room in zip(req_ids, drafts, rooms)]
        batch = len(req_ids)
        if self.tail_gate is not None and batch >= self.policy.gate_min_rows and any(extras):
            with self._timed():
                costs = self.gate.costs
                lengths = [len(row) for row in drafts]
                verify = costs.verify_list(batch * (self.num_speculative_tokens + 1))
                offered = [len(e) for e in extras]
                keep = self.tail_gate.length(lengths, offered, forwards * costs.draft(batch), verify)
                extras = [e[:keep] for e in extras]
                self.stats.tail_cut += sum(offered) - sum(map(len, extras))
        out = []
        for req_id, row, extra in zip(req_ids, drafts, extras):
            if extra:
                self._before_tail[req_id] = len(row)
                self.stats.record_tail(req_id, len(extra))
            out.append(row + extra)
        self.stats.record_proposed([len(row) for row in out])
        if self._last_draft_probs is not None and self._before_tail:  # drafts drawn from distributions
            starts = [self._before_tail.get(r, len(row)) for r, row in zip(req_ids, out)]
            self._last_draft_probs = with_tail_probs(self._last_draft_probs, out, starts)  # [B, T', V]
        return out

    def _agree(self, active: list[bool], lengths: list[int], device: torch.device) -> tuple[list[bool], list[int]]:
        """Tensor parallelism: every rank takes rank 0's rows still drafting and lengths."""
        both = torch.tensor([active, lengths], dtype=torch.long, device=device)  # [2, B]
        active, lengths = self._tp_group.broadcast(both, src=0).tolist()
        return [bool(a) for a in active], lengths

    # -- measured costs (adaptive_spec.costs = "online"): the loop's own clocks, at its host syncs --

    @property
    def _meter(self):
        """The gate's cost meter (costs: online), else None."""
        return None if self.gate is None else self.gate.meter

    def _meter_pass(self, req_ids: list[str], generated: list[int]) -> bool:
        """At the start of a round, after verification's host copy: the time since the last round ended
        is one target pass over the tokens it verified, plus sampling and the engine's bookkeeping.
        Measured only on steady decode steps: the same requests as last round, every one decoding (no
        prefill, no idle engine in between, and no request that finished last step: the engine's work
        on finished and new requests made those steps slower than their token count says). Returns
        whether this round is such a steady one (its draft steps are measured too)."""
        meter, clock = self._meter, self.stats.clock
        if meter is None and clock is None:
            return False
        now, last, self._last_round = time.perf_counter(), self._last_round, None
        if last is None or not all(n > 0 for n in generated) or last[0] != set(req_ids):
            return False
        if clock is not None:
            clock.add_steady_gap(now - last[1])
        if meter is not None:
            tokens = len(req_ids) + sum(self._verified_drafts or ())
            meter.add("verify_ms", tokens, 1e3 * (now - last[1]))
        return meter is not None

    def _meter_round(self, req_ids: list[str], steps_start: float | None, forwards: int) -> None:
        """At the end of a round (after the drafts' host copy): a draft step's cost at this batch, what
        one more step adds (its forward, logits, draw, the policy and the gate), from the steps after
        the first pass (a round of one forward measures none)."""
        meter = self._meter
        if meter is None and self.stats.clock is None:
            return
        now = time.perf_counter()
        if meter is not None and steps_start is not None and forwards > 1:
            meter.add("draft_step_ms", len(req_ids), 1e3 * (now - steps_start) / (forwards - 1))
        self._last_round = (set(req_ids), now)

    def _observe_context(self, req_ids: list[str], hidden: torch.Tensor, cad: Any, rejected: torch.Tensor | None):
        """Give the policy the first pass's rows of each request's verified tokens (one host copy per round).

        After set_inputs_first_pass request i owns rows qsl[i]..qsl[i+1]-1: its
        valid tokens, the new bonus token, then its rejected drafts (padded batch)."""
        batch = len(req_ids)
        qsl = cad.query_start_loc_cpu[: batch + 1].tolist()
        first = self.positions[cad.query_start_loc[:batch]].long()  # [B]
        rej = torch.zeros_like(first) if rejected is None else rejected[:batch].long()  # [B]
        positions, num_rejected = torch.stack([first, rej]).tolist()
        lengths = [qsl[i + 1] - qsl[i] - num_rejected[i] for i in range(batch)]
        self.policy.observe_context(req_ids, hidden, qsl[:-1], lengths, positions)

    def _draft_step_inputs(
        self,
        t: int,
        tokens: torch.Tensor,
        carried: torch.Tensor,
        positions,
        cad,
        launch,
        rejected,
        rows: _Rows | None = None,
        active: list[bool] | None = None,
    ):
        """Inputs of draft step t >= 1 from step t-1's tokens [B] and carried state [B, hidden]: positions,
        slot mapping and attention metadata one further, the tokens and state into the drafter's buffers.
        None of it depends on step t-1's decisions (rows that stopped stay in the batch), so the loop may
        run it before it waits for them (prepare_ahead); a round that then ends has prepared one step in
        vain, which only moves the drafter's buffers and this round's metadata (vLLM's loop advances
        them K-1 times, whatever K). With `rows` (compact_drafts) the step computes only the rows still
        drafting by `active` once they are at most half of the last step's (the rows known to have
        stopped when this runs: with prepare_ahead, before step t-1's decisions).
        Returns (positions, attention metadata, launch, (per-layer attention metadata, model inputs))."""
        batch = tokens.shape[0]
        if t == 1:
            launch = self._enter_decode(cad, batch, rejected)
        if rows is not None and active is not None:
            cut = rows.shrink(active)  # places of the last forward's rows still drafting, or None
            if cut is not None:
                cad = _compact_metadata(cad, *cut, self.arange, self.token_arange_np)
                positions = positions[cut[0]]
                launch = self._determine_batch_execution_and_padding(rows.n)
        n = batch if rows is None else rows.n
        num_input = launch[1]
        positions = self._update_positions_dependent_metadata(positions, cad, n, num_input, self.block_size)
        _, per_layer_md = self.build_per_group_and_layer_attn_metadata(cad, draft_index=t)
        self.input_ids[:n] = tokens.int() if rows is None else rows.gather(tokens).int()
        model_inputs = {
            "input_ids": self.input_ids[:num_input],
            "positions": self._get_positions(num_input),
            "inputs_embeds": None,
        }
        if self.pass_hidden_states_to_model:  # EAGLE: the head reads its own last state
            self.hidden_states[:n] = carried if rows is None else rows.gather(carried)
            model_inputs["hidden_states"] = self.hidden_states[:num_input]
        return positions, cad, launch, (per_layer_md, model_inputs)

    def _enter_decode(self, cad: Any, batch: int, num_rejected_tokens_gpu: torch.Tensor | None):
        """Switch the attention metadata from the first pass to one token per row."""
        cad.num_actual_tokens = batch
        cad.max_query_len = 1
        cad.query_start_loc = self.arange[: batch + 1]
        cad.query_start_loc_cpu = torch.from_numpy(self.token_arange_np[: batch + 1]).clone()
        if num_rejected_tokens_gpu is not None:
            # Padded batch: the first pass also covered rejected slots; drop them.
            cad.seq_lens -= num_rejected_tokens_gpu
        return self._determine_batch_execution_and_padding(batch)


class _Rows:
    """compact_drafts: the rows a round's draft forwards compute. Once the rows still drafting are at most
    half of those the last forward computed (`rows_to_compute`), the next forwards run on them only; what
    a forward returns for its rows is written into full-batch tensors (rows that stopped keep their last
    values there, which nothing reads), so the logits, the policy and the bookkeeping see the batch."""

    def __init__(self, batch: int, device: torch.device):
        self.batch, self.device = batch, device
        self.rows: list[int] = list(range(batch))  # batch rows the forwards compute, in their order
        self.index: torch.Tensor | None = None  # [n] the same on the device; None while all rows run
        self.saved = 0  # row computations the round left out (statistics)
        self._full: dict[str, torch.Tensor] = {}  # kind -> [B, ...], once the batch has shrunk

    @property
    def n(self) -> int:
        return len(self.rows)

    def shrink(self, active: list[bool]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Before a forward: keep the rows still drafting if `rows_to_compute` says so. Returns their
        places among the rows the last forward computed, [n] on the device and on the host (what the
        metadata, the positions and the carried state are cut with), or None when the batch stays as
        it is. On CUDA a cut copies those places to the device once (a host sync; a few per round at
        most); the batch rows follow from them on the device."""
        keep = [i for i, r in enumerate(self.rows) if active[r]]
        cut = None
        if rows_to_compute(self.n, len(keep)) < self.n:
            on_host = torch.tensor(keep)
            cut = on_host.to(self.device), on_host
            self.rows = [self.rows[i] for i in keep]
            self.index = cut[0] if self.index is None else self.index[cut[0]]  # [n] batch rows
        self.saved += self.batch - self.n
        return cut

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, ...] -> [n, ...]: the rows the forward computes."""
        return x if self.index is None else x[self.index]

    def expand(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] a forward's rows -> [B, ...] (one buffer per kind, written in place each step)."""
        full = self._full.get(kind)
        if full is None:
            full = self._full[kind] = torch.zeros((self.batch, *x.shape[1:]), dtype=x.dtype, device=x.device)
        return full.index_copy_(0, self.index, x)


# CommonAttentionMetadata's optional per-row fields that a compacted decode step cuts like seq_lens (none of
# them is set for the drafters the plugin serves today; each one that is set is cut, never left whole)
_PER_ROW_OPTIONAL = (
    "seq_lens_cpu_upper_bound",
    "dcp_local_seq_lens",
    "dcp_local_seq_lens_cpu_upper_bound",
    "is_prefilling",
    "rswa_prefix_lens",
    "replayssm_decode_base_cpu",
    "encoder_seq_lens",
    "encoder_seq_lens_cpu",
    "req_idx",
)


def _compact_metadata(
    cad: Any, keep: torch.Tensor, keep_cpu: torch.Tensor, arange: torch.Tensor, arange_np: Any
) -> Any:
    """Decode-step attention metadata (one token per row) cut to the rows `keep` of `cad`'s rows ([n] on
    cad's device; keep_cpu: the same on the host, for its CPU fields)."""
    n = keep.shape[0]
    fields: dict[str, Any] = {
        "query_start_loc": arange[: n + 1],
        "query_start_loc_cpu": torch.from_numpy(arange_np[: n + 1]).clone(),
        "seq_lens": cad.seq_lens[keep],
        "num_reqs": n,
        "num_actual_tokens": n,
        "block_table_tensor": cad.block_table_tensor[keep],
        "slot_mapping": cad.slot_mapping[keep],
        "positions": None if cad.positions is None else cad.positions[keep],
        "_num_computed_tokens_cache": None,
        "_token_to_req_indices_cache": None,
    }
    if isinstance(cad.causal, torch.Tensor) and cad.causal.dim() > 0:
        fields["causal"] = cad.causal[keep]
    for name in _PER_ROW_OPTIONAL:
        value = getattr(cad, name, None)
        if isinstance(value, torch.Tensor):
            fields[name] = value[keep if value.device == keep.device else keep_cpu]
        elif value is not None:  # a numpy array (req_idx)
            fields[name] = value[keep_cpu.numpy()]
    return cad.replace(**fields)


def _account(
    t: int,
    keeps: list[bool],
    stops: list[bool],
    limits: list[int],
    active: list[bool],
    lengths: list[int],
    drawn: list,
    floor: int = 0,
) -> list[bool]:
    """Step t's decisions for the rows still drafting: updates active, lengths and drawn (tokens drawn
    while drafting) in place -> the rows that drafted y_t and kept it. A row below `floor` kept tokens
    keeps y_t and goes on whatever its policy said (more drafts stay lossless: verification decides)."""
    kept = [False] * len(active)
    for i, drafting in enumerate(active):
        if drafting:
            keep = keeps[i] or lengths[i] < floor
            drawn[i] += 1
            kept[i] = keep
            lengths[i] += keep
            active[i] = keep and (not stops[i] or lengths[i] < floor) and limits[i] > t + 1
    return kept


class AdaptiveDraftModelProposer(AdaptiveDraftLoop, DraftModelProposer):
    """method "draft_model": an independent draft LM; everything as vLLM's."""

    skips_first_pass = True  # its first pass re-reads the verified tokens (no hidden states of the target)


class _FusedFeatures:
    """Drafters that read several target layers, fused by the drafter's fc (as vLLM's propose does)."""

    def _first_pass_features(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        if self.method in ("eagle3", "dflash"):
            return self.model.combine_hidden_states(target_hidden_states)
        return target_hidden_states


class AdaptiveEagleProposer(_FusedFeatures, AdaptiveDraftLoop, EagleProposer):
    """methods "eagle", "eagle3" and "mtp": a head (or the target's own MTP layer) that reads the target's
    hidden states and its own last state."""


class AdaptiveDFlashProposer(_FusedFeatures, AdaptiveDraftLoop, DFlashProposer):
    """method "dflash": a block drafter; one forward drafts the block, the policy cuts it per request."""


# speculative_config.method -> the adaptive drafter (keys: hooks.SUPPORTED_METHODS)
DRAFTERS: dict[str, type[AdaptiveDraftLoop]] = {
    "draft_model": AdaptiveDraftModelProposer,
    "eagle": AdaptiveEagleProposer,
    "eagle3": AdaptiveEagleProposer,
    "mtp": AdaptiveEagleProposer,  # vLLM drafts with MTP layers through its EagleProposer too
    "dflash": AdaptiveDFlashProposer,
}
