"""The version layer's table holds for the vLLM of this venv, read from vLLM's real classes.

Runs under each scheduler-level venv (0.32, 0.33, 0.34): every row of
``kvguard.vllm_plugin.versions.TOUCH_POINTS`` says what the touch point is in this release,
and this test reads it back from vLLM itself (a class's methods, a dataclass's fields, a
real scheduler's instance attributes and blocks; a connector's attributes from its class's
source, since NIXL's classes need NIXL and a GPU to build), so the docs' table cannot
drift from vLLM either.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import vllm
from _sched import Sched
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput

from kvguard.vllm_plugin.versions import (
    TOUCH_POINTS,
    Presence,
    TouchPoint,
    pool_tag,
    release_of,
)

CLASSES: dict[str, type] = {"Scheduler": Scheduler, "BlockPool": BlockPool,
                            "KVCacheCoordinator": KVCacheCoordinator,
                            "KVCacheManager": KVCacheManager,
                            "KVCacheBlock": KVCacheBlock, "ModelRunnerOutput": ModelRunnerOutput}


def _changed(tp: TouchPoint, s: Sched) -> bool:
    """Whether ``tp`` has the changed shape its note describes (vLLM 0.34's)."""
    pool = s.pool
    if tp.label == "BlockPool.free_blocks":
        return "evict_first" in inspect.signature(BlockPool.free_blocks).parameters
    if tp.label == "KVCacheBlock.pool":
        return isinstance(pool.blocks[1].pool, weakref.ref) and pool.blocks[1].pool() is pool
    if tp.label == "BlockPool.cached_block_hash_to_block":
        return hasattr(pool.cached_block_hash_to_block, "_dup_ids")  # ids, not blocks
    raise AssertionError(f"no check for a changed {tp.label}")


def _defined_in_source(tp: TouchPoint) -> bool:
    """Whether vLLM's own source of ``tp.source`` has class ``tp.owner`` define ``tp.name``
    (a method, a class-level field or enum member, or ``self.<name> = ...`` in one of its
    methods), or, for a ``module ...`` kind, has the module define it at top level."""
    tree = ast.parse((Path(vllm.__file__).parent / tp.source).read_text())
    if tp.kind.startswith("module "):  # a module's own class or global, ``owner`` the module
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == tp.name:
                return True
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            if any(isinstance(t, ast.Name) and t.id == tp.name for t in targets):
                return True
        return False
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        if cls.name != tp.owner:
            continue
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == tp.name:
                return True
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            for t in targets:
                if (isinstance(t, ast.Name) and t.id == tp.name) or (
                        isinstance(t, ast.Attribute) and t.attr == tp.name
                        and isinstance(t.value, ast.Name) and t.value.id == "self"):
                    return True
    return False


def _presence(tp: TouchPoint, s: Sched) -> Presence:
    if tp.source:
        return Presence.PRESENT if _defined_in_source(tp) else Presence.ABSENT
    cls = CLASSES[tp.owner]
    if tp.kind in ("method", "called method"):
        present = callable(getattr(cls, tp.name, None))
    elif tp.kind == "dataclass field":
        present = tp.name in {f.name for f in dataclasses.fields(cls)}
    else:  # an instance attribute of the real scheduler's objects
        obj: Any = {"Scheduler": s.scheduler, "BlockPool": s.pool}[tp.owner]
        present = hasattr(obj, tp.name)
    if not present:
        return Presence.ABSENT
    if Presence.CHANGED in tp.presence:  # a row that changed in some release: which shape?
        return Presence.CHANGED if _changed(tp, s) else Presence.PRESENT
    return Presence.PRESENT


def test_every_touch_point_is_what_the_version_table_says_for_this_vllm(
        sched: Callable[..., Sched]) -> None:
    release = release_of(vllm.__version__)
    assert release is not None, f"vLLM {vllm.__version__} is not in versions.RELEASES"
    s = sched()
    wrong = {tp.label: (tp.in_release(release).value, _presence(tp, s).value)
             for tp in TOUCH_POINTS if _presence(tp, s) is not tp.in_release(release)}
    assert wrong == {}, f"vLLM {vllm.__version__}: label -> (table, vLLM): {wrong}"


def test_pool_tag_is_what_the_pools_own_blocks_hold(sched: Callable[..., Sched]) -> None:
    s = sched()
    tag = pool_tag(s.pool)
    assert all(b.pool is tag for b in s.pool.blocks)


def test_the_pool_and_its_tag_select_the_same_blocks(sched: Callable[..., Sched]) -> None:
    """Callers of ``block_ids_in`` may pass the pool (as before 0.34) or its tag."""
    from kvguard.vllm_plugin.pool_reader import block_ids_in

    s = sched()
    blocks = s.pool.blocks
    ids = block_ids_in(blocks, s.pool)
    assert ids == block_ids_in(blocks, pool_tag(s.pool)) == list(range(1, len(blocks)))


def test_kv_cache_manager_free_reads_only_the_request_id() -> None:
    """Reclaim hands ``KVCacheManager.free`` a stand-in for a request vLLM forgot
    (``released_request``: its ``request_id`` only); this vLLM's source must read nothing
    else of the request."""
    fn = ast.parse(inspect.cleandoc("\n" + inspect.getsource(KVCacheManager.free)))
    [func] = [n for n in ast.walk(fn) if isinstance(n, ast.FunctionDef)]
    param = func.args.args[1].arg
    reads = {n.attr for n in ast.walk(func) if isinstance(n, ast.Attribute)
             and isinstance(n.value, ast.Name) and n.value.id == param}
    passed = [n for n in ast.walk(func) if isinstance(n, ast.Name) and n.id == param
              and not any(isinstance(a, ast.Attribute) and a.value is n
                          for a in ast.walk(func))]
    assert (reads, passed) == ({"request_id"}, []), (reads, len(passed))


def test_block_hash_attr_is_where_this_vllms_blocks_keep_their_hash(
        sched: Callable[..., Sched]) -> None:
    """The row present in this release names the slot, and vLLM's own cached blocks carry
    their hash there (the name ``BlockPool.cached_block_hash_to_block`` is keyed by)."""
    from _sched import prompt

    from kvguard.vllm_plugin.versions import BLOCK_HASH_FIELD, BLOCK_HASH_SLOT, block_hash_attr

    release = release_of(vllm.__version__)
    assert release is not None
    s = sched()
    attr = block_hash_attr(s.pool.blocks[1])
    present = [tp.name for tp in (BLOCK_HASH_SLOT, BLOCK_HASH_FIELD)
               if tp.in_release(release) is Presence.PRESENT]
    assert [attr] == present
    s.add(prompt(3, 64), 4)
    s.run_to_completion()
    cached = [b for b in s.pool.blocks if getattr(b, attr) is not None]
    assert len(cached) == len(s.pool.cached_block_hash_to_block) > 0
