"""``gpu_grpo.py --variants``: run the StreamRFT system once per named set of config overrides (memory options).

Spec: ``"name:key=value,key=value;name2:key=value"``. A variant is ``name`` or ``name:`` (no overrides: the
benchmark's own settings) or ``name:overrides``; overrides are comma-separated ``key=value`` pairs with dotted
config keys, exactly what ``STREAMRFT_BENCH_EXTRA`` and the ``streamrft train`` command line take. A comma inside
brackets belongs to the value (``model.lora_target_modules=[q_proj,v_proj]``). Parsing is pure and strict: a
bad spec stops the benchmark before any model is built (an error naming the variant), not a GPU call later.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")  # goes into file names (run_SIZE_streamrft-NAME-r1)
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")  # section.key (dotted, no top-level)


def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside [] / () / {} (list and tuple values keep their commas)."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "[({":
            depth += 1
        elif ch in "])}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def parse_variants(spec: str) -> list[tuple[str, list[str]]]:
    """``[(name, ["key=value", ...]), ...]`` in the spec's order; ValueError naming the variant on bad input."""
    out: list[tuple[str, list[str]]] = []
    for i, chunk in enumerate(_split_top(spec, ";")):
        chunk = chunk.strip()
        if not chunk:
            if i == 0 and not spec.strip():
                raise ValueError("--variants is empty; give name:key=value,...;name2:... (or leave the flag out)")
            continue  # a trailing ';'
        name, _, body = chunk.partition(":")
        name = name.strip()
        if not _NAME.match(name):
            raise ValueError(f"--variants: variant #{i + 1} {chunk!r}: name {name!r} must be letters, digits, "
                             "'_', '.', '+' or '-' (it becomes part of a file name)")
        if name in (n for n, _ in out):
            raise ValueError(f"--variants: variant name {name!r} appears twice")
        overrides = []
        for pair in (p.strip() for p in _split_top(body, ",")):
            if not pair:
                continue
            key, eq, value = pair.partition("=")
            key = key.strip()
            if not eq or not _KEY.match(key):
                raise ValueError(f"--variants: variant {name!r}: {pair!r} is not section.key=value")
            if any(o.split("=", 1)[0] == key for o in overrides):
                raise ValueError(f"--variants: variant {name!r} sets {key} twice")
            overrides.append(f"{key}={value.strip()}")
        out.append((name, overrides))
    return out


def variants_table(rows: list[dict]) -> str:
    """One line per variant run: the speed and memory columns of the memory-options table.

    ``rows``: result dicts of the StreamRFT worker with ``variant`` and ``overrides`` added (or ``error``)."""
    head = (f"{'size':5} {'variant':16} {'step_s':>7} {'train_s':>7} {'roll_s':>7} {'peak_GiB':>8} {'resv_GiB':>8} "
            f"  ckpt_s per step | overrides")
    lines = [head]
    for r in rows:
        over = " ".join(r.get("overrides", [])) or "-"
        name = r.get("system", r.get("variant", "?")).removeprefix("streamrft-")  # the run: variant (+ -r2 ...)
        if "error" in r:
            lines.append(f"{r.get('size', '?'):5} {name:16} FAILED: {r['error'][-300:]}  [{over}]")
            continue
        # what saving blocked each step (checkpoint.save_every / async_save; the last step also saves)
        ck = "/".join("-" if x is None else f"{x:.2f}" for x in r.get("checkpoint_times", []))
        lines.append(f"{r['size']:5} {name:16} {r['step_s']:7.2f} {r['train_s']:7.2f} {r['rollout_s']:7.2f} "
                     f"{r['peak_gib']:8.1f} {r['peak_reserved_gib']:8.1f}  {ck or '-'} | {over}")
    return "\n".join(lines)


def plan_jobs(sizes: list[str], systems: list[str], variants: list[tuple[str, list[str]]] | None = None,
              repeat: int = 1) -> list[dict]:
    """The worker runs of one call, in order: per size the systems as listed, the ``streamrft`` system once per
    variant (or once), each StreamRFT run ``repeat`` times in a row (the second finds the compile cache warm);
    ``eager`` at the first size only, last (slow). A job: size, worker kind, tag (unique per size: file names
    and table rows), variant name, overrides."""
    if repeat < 1:
        raise ValueError(f"--repeat-streamrft={repeat} must be >= 1")
    jobs: list[dict] = []
    for size in sizes:
        for system in systems:
            if system == "eager":
                continue
            runs = [(f"streamrft-{n}", n, o) for n, o in variants] if system == "streamrft" and variants else \
                [(system, "", [])]
            for tag, name, over in runs:
                for r in range(1, (repeat if system == "streamrft" else 1) + 1):
                    jobs.append(dict(size=size, kind=system, tag=tag if r == 1 else f"{tag}-r{r}", variant=name,
                                     overrides=list(over)))
    if "eager" in systems:
        jobs.append(dict(size=sizes[0], kind="eager", tag="eager", variant="", overrides=[]))
    return jobs


def worker_result(cmd: list[str], res_path: Path, timeout: float, env: dict | None = None) -> dict:
    """Run one worker subprocess (a system or a variant, gpu_grpo.py and learner_profile.py) and read the result
    JSON it writes to ``res_path``; a worker that wrote none, or ran past ``timeout`` seconds, gives
    {"error": why}: the parent reports it and goes on with the next."""
    res_path.unlink(missing_ok=True)
    try:
        subprocess.run(cmd, timeout=timeout, check=False, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after --timeout {timeout:g} s"}
    return json.loads(res_path.read_text()) if res_path.exists() else {"error": "the worker wrote no result file"}
