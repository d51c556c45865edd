"""No content leaks: prompts with canary markers through the real OpenAI server.

The markers (in-vocabulary words of the tiny model's word-level tokenizer, and
a unique string it does not know) and the prompt's token ids, as a sequence,
must appear in no report, metric, API answer, log line or file kvguard writes.
kvguard is made as talkative as it gets: a leak report naming the request
(an injected skipped free on an abort), hook errors with tracebacks, and
checkpoint requests from the sidecar.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer

from kvguard.demo.run import make_sure_an_abort_arrived, wait_for_checkpoint
from kvguard.sidecar.app import create_app
from kvguard.sidecar.store import EngineStore
from kvguard.testing.engine import EngineSpec, ServerProcess
from kvguard.testing.tiny_model import WORDS, make_tiny_model
from kvguard.testing.workload import cancel_mid_stream, stream_completion

HERE = Path(__file__).resolve().parent
HOOK_ERROR_SCHEDULER = "_hook_error_scheduler.HookErrorScheduler"

pytestmark = pytest.mark.server

OUT_OF_VOCAB = "KvgCanary7f3a9cZq"
"""A string seen nowhere else: the tokenizer maps it to <unk>, so only its text could leak."""

_LOG_RECORD = re.compile(
    r"^(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) "  # vLLM's records
    r"|^[WIEF]\d{4} |^\[|^/|^[A-Z]+: "  # glog, [rank0]:, Python warnings, uvicorn
    r"|^kvguard", re.IGNORECASE)  # kvguard's records ("(kvguard pid=N) LEVEL ..." or bare)


def _marker_words(tokenizer: Tokenizer) -> list[str]:
    """Filler words of the vocabulary (``w17`` ...): unlikely anywhere but in our prompts."""
    fillers = [w for w in tokenizer.get_vocab() if re.fullmatch(r"w\d{2,3}", w)]
    picked = sorted(fillers, key=lambda w: (int(w[1:]) * 7919) % 1009)[:12]
    assert len(picked) == 12 and not set(picked) & set(WORDS)
    return picked


def _id_patterns(ids: list[int]) -> list[str]:
    """Every 3 consecutive prompt ids, written the ways a program would write a list."""
    out = []
    for i in range(len(ids) - 2):
        a, b, c = ids[i:i + 3]
        out += [f"{a}, {b}, {c}", f"{a},{b},{c}", f"{a} {b} {c}", f"{a}\n{b}\n{c}"]
    return out


def _kvguard_log_records(log_text: str) -> list[str]:
    """kvguard's log records in the server log, continuation lines included.

    vLLM's own records are not kvguard's to police. Every kvguard record starts
    with "(kvguard pid=N)" (its own handler) or "kvguard"; a leak explanation or a
    traceback continues on the lines
    after it, which belong to the same record.
    """
    records: list[list[str]] = []
    for line in log_text.splitlines():
        if _LOG_RECORD.match(line) or not records:
            records.append([line])
        else:
            records[-1].append(line)
    return ["\n".join(r) for r in records
            if r[0].lower().startswith(("kvguard", "(kvguard pid="))]


def test_prompts_never_reach_reports_metrics_logs_or_files(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model")
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    markers = _marker_words(tokenizer)
    run_dir = tmp_path / "run"
    # Long generations (up to 2048 tokens) so that a cancel lands mid-stream; the
    # abort API needs --enable-scale-out.
    spec = EngineSpec(model_dir=model, num_gpu_blocks_override=128, max_model_len=2048,
                      max_num_seqs=8, max_num_batched_tokens=2048,
                      extra={"enable_scale_out": True, "scheduler_cls": HOOK_ERROR_SCHEDULER})
    env = {"VLLM_PLUGINS": "kvguard", "KVGUARD_RUN_DIR": str(run_dir),
           "KVGUARD_ENGINE_NAME": "canary", "KVGUARD_ALLOW_FAULTS": "1",
           "KVGUARD_FAULTS": "skip_free_on_abort=1", "KVGUARD_TEST_HOOK_ERRORS": "2",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "KVGUARD_DELAYED_FREE_BOUND_SECONDS": "0"}
    prompts = [" ".join([*markers[k:], OUT_OF_VOCAB, *markers[:k], *WORDS[40:40 + 8 * k]])
               for k in range(4)]
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    assert all(0 in ids for ids in prompt_ids)  # the out-of-vocabulary canary is <unk>

    log_path = tmp_path / "server.log"
    with ServerProcess(spec, log_path=log_path, env=env) as server:
        model_name = spec.served_model_name
        for p in prompts[:2]:
            assert stream_completion(server.base_url, model_name, p, 24,
                                     disconnect_after_chunks=None)
        hung_up = time.time()
        for p in prompts[2:]:  # cancelled mid-stream: aborts; the first one leaks (injected)
            assert not cancel_mid_stream(server.base_url, model_name, p, 1900), \
                "the stream ran to the end: not cancelled"
        # vLLM can lose an abort on a loaded host: cancel again (with a canary prompt)
        assert make_sure_an_abort_arrived(server.base_url, model_name, run_dir,
                                          engine="canary", prompt=prompts[3]), \
            "no abort reached the engine"
        state = wait_for_checkpoint(run_dir, after=hung_up, engine="canary")
        deadline = time.monotonic() + 60
        while (state.latest_report is None or state.latest_report.verdict.value != "leak") \
                and time.monotonic() < deadline:
            time.sleep(0.25)
            state = wait_for_checkpoint(run_dir, after=hung_up, engine="canary")
        store = EngineStore(run_dir)
        store.refresh()
        with TestClient(create_app(store)) as sidecar:
            assert sidecar.post("/v1/checkpoints").status_code == 202
            answers = {path: sidecar.get(path).text for path in
                       ("/metrics", "/healthz", "/v1/report", "/v1/checkpoints")}
        time.sleep(1.5)  # let the engine see the checkpoint request and publish again
    report = state.latest_report
    assert report is not None and report.verdict.value == "leak"  # kvguard had things to say
    assert state.hook_errors_total == 2

    texts = {f"file {p.relative_to(run_dir)}": p.read_bytes().decode(errors="replace")
             for p in sorted(run_dir.rglob("*")) if p.is_file()}
    assert any(name.endswith("canary.json") for name in texts)
    texts |= {f"sidecar {path}": body for path, body in answers.items()}
    for args in (["report"], ["report", "--json"]):
        out = subprocess.run([sys.executable, "-m", "kvguard.cli.main", *args, "--run-dir",
                              str(run_dir)], capture_output=True, text=True, timeout=60)
        texts[f"kvguard {' '.join(args)}"] = out.stdout + out.stderr
    log_records = _kvguard_log_records(log_path.read_text(errors="replace"))
    assert any("LEAK" in r for r in log_records) and any("hook" in r for r in log_records)
    texts["server log (kvguard records)"] = "\n".join(log_records)

    needles = [*markers, OUT_OF_VOCAB, *(s for ids in prompt_ids for s in _id_patterns(ids))]
    search = re.compile("|".join(rf"(?<!\w){re.escape(n)}(?!\w)" for n in needles))
    # The search finds a prompt, or its ids written as a list, when they are there.
    assert search.search(json.dumps({"prompt": prompts[3]}))
    assert search.search(json.dumps({"prompt_token_ids": prompt_ids[1]}))
    assert search.search(repr(prompt_ids[2][5:9]))
    found = {(where, m.group()) for where, text in texts.items()
             for m in search.finditer(text)}
    assert not found, sorted(found)[:20]
    print(f"[reliability] canary: {len(needles)} needles (markers, canary, id sequences) "
          f"searched in {len(texts)} outputs ({sum(map(len, texts.values()))} chars, "
          f"{len(log_records)} kvguard log records): none found")
