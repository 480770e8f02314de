"""minillm against the engines a reader would pick instead, on the same weights:
``python -m minillm bench peers``.

The contenders, per format (``CONTENDERS``): minillm's runtime (fp32; int8 weight-only, W8A8;
int4 in groups of 32, chapter 12's formats, compiled as chapter 11 does it), torchao's configs
on the same minillm model and decode loop (int8 weight-only, int8 dynamic activations, int4),
and llama.cpp through llama-cpp-python on GGUF files this package writes from the same
checkpoint (F32, Q8_0, Q4_0: ``export.gguf``). Each contender is a process of its own
(``peer_worker``), one thread, loaded and warmed once; within a format they take turns, round
after round, each decoding the same prompt greedily for the same number of tokens, and the
median of their decode tokens/s over the rounds is reported. Tokens are compared with minillm's
fp32 ones: llama.cpp's F32 computes the same function in another order (equal tokens expected),
the others round it.

A peer that is not installed is a row saying so and how to get it (``pip install
minillm[peers]``): nothing here is a dependency of minillm or of its tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.checkpoints import resolve, save_pretrained
from ..core.config import shape_config
from ..core.model import random_model
from ..core.tokenizer import Tokenizer
from ..measure.report import PAGE_WIDTH, describe, finish_provenance, format_table, provenance

FORMATS = ("fp32", "int8", "int4")
PEERS = {  # engine -> (the module it needs, how to install it)
    "llama.cpp": ("llama_cpp", "pip install 'minillm[peers]' (or llama-cpp-python gguf)"),
    "torchao": ("torchao", "pip install 'minillm[peers]' (or torchao)"),
}
GGUF_TYPE = {"F32": "f32", "Q8_0": "q8_0", "Q4_0": "q4_0"}


@dataclass(frozen=True)
class Contender:
    engine: str  # "minillm", "torchao", "llama.cpp"
    format: str  # the worker's format: minillm/torchao "fp32", "int8", "w8a8", "int4"; llama.cpp a GGUF type
    group: str  # the format group it is compared in: fp32, int8, int4

    @property
    def label(self) -> str:
        names = {"int8": "int8 weight-only", "w8a8": "W8A8", "int4": "int4 g32", "fp32": "fp32"}
        return names.get(self.format, self.format)


CONTENDERS = (
    Contender("minillm", "fp32", "fp32"),
    Contender("llama.cpp", "F32", "fp32"),
    Contender("minillm", "int8", "int8"),
    Contender("minillm", "w8a8", "int8"),
    Contender("torchao", "int8", "int8"),
    Contender("torchao", "w8a8", "int8"),
    Contender("llama.cpp", "Q8_0", "int8"),
    Contender("minillm", "int4", "int4"),
    Contender("torchao", "int4", "int4"),
    Contender("llama.cpp", "Q4_0", "int4"),
)


def missing_peer(engine: str) -> str | None:
    """Why ``engine`` cannot run here (not installed, and the command that installs it), or None."""
    if engine == "minillm":
        return None
    needed = [PEERS[engine][0]] + (["gguf"] if engine == "llama.cpp" else [])
    if any(importlib.util.find_spec(m) is None for m in needed):
        return f"not installed: {PEERS[engine][1]}"
    return None


@dataclass
class PeersBench:
    model: str | None = "minillm-target"  # a trained model (bundled name or directory); or None and a shape
    shape: str | None = None  # a preset's name: random weights of that shape (seeded)
    formats: Sequence[str] = FORMATS
    prompt_len: int = 64
    new_tokens: int = 128
    rounds: int = 5  # turns each contender takes; the median is reported
    compile: bool = True  # minillm and torchao decode compiled (the fastest path of each)
    threads: int = 1
    load_timeout: float = 1200.0  # seconds a contender may take to load, warm up and compile
    run_timeout: float = 600.0  # seconds one decode may take
    seed: int = 0
    progress: bool = False

    def __post_init__(self):
        if (self.model is None) == (self.shape is None):
            raise ValueError("give a model (trained weights) or a shape (random weights), not both")
        self.formats = tuple(self.formats)
        unknown = set(self.formats) - set(FORMATS)
        if unknown or not self.formats:
            raise ValueError(f"formats must be some of {FORMATS}, got {list(self.formats)}")
        for name in ("prompt_len", "new_tokens", "rounds", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.new_tokens < 2:
            raise ValueError("new_tokens must be at least 2: decode is timed after the first token")


class WorkerError(RuntimeError):
    """A contender's process failed, answered an error or ran past its timeout."""


class Worker:
    """One ``peer_worker`` process: requests in on stdin, answers out on stdout, every wait bounded."""

    def __init__(self, name: str, threads: int):
        self.name = name
        env = {**os.environ, "MINILLM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by close(): it outlives this call)
        command = [sys.executable, "-m", "minillm.bench.peer_worker"]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # end of output: the process is gone

    def request(self, message: dict, timeout: float) -> dict:
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            line = self.lines.get(timeout=timeout)
        except (BrokenPipeError, OSError):
            line = ""
        except queue.Empty:
            raise WorkerError(f"{self.name}: no answer within {timeout:.0f} s") from None
        if not line:
            raise WorkerError(f"{self.name} exited (status {self.proc.poll()}): {self.last_words()}")
        answer = json.loads(line)
        if "error" in answer:
            raise WorkerError(f"{self.name}: {answer['error']}")
        return answer

    def last_words(self) -> str:
        self.log.seek(0)
        lines = [line for line in self.log.read().splitlines() if line.strip()]
        return lines[-1] if lines else "nothing on stderr"

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            self.proc.stdin.write(json.dumps({"stop": True}) + "\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


def prepare_weights(o: PeersBench, directory: Path) -> tuple[Path, Tokenizer, list[int], str]:
    """(checkpoint directory, tokenizer, prompt ids, what the weights are): the trained model's
    own directory and a prompt from its corpus, or random weights of ``o.shape`` saved there and
    a random prompt. The bundled tokenizer goes into a GGUF file of a random shape, its vocabulary
    padded (the prompt is ids: nothing is tokenized)."""
    from ..core.checkpoints import load
    from ..training.corpus import corpus_prompts

    gen = torch.Generator().manual_seed(o.seed)
    if o.model is not None:
        path = resolve(o.model)
        _, tokenizer = load(path, device="cpu")
        prompt = corpus_prompts(tokenizer, 1, o.prompt_len)[0]
        return path, tokenizer, list(prompt), f"{o.model} (trained)"
    config = shape_config(o.shape)
    torch.manual_seed(o.seed)
    model = random_model(config, torch.device("cpu"), torch.float32)
    _, tokenizer = load(resolve("minillm-target"), device="cpu")
    path = save_pretrained(model, directory / "checkpoint")
    prompt = torch.randint(0, config.vocab_size, (o.prompt_len,), generator=gen).tolist()
    return path, tokenizer, prompt, f"random {config.name} (seed {o.seed})"


def gguf_file(checkpoint: Path, tokenizer: Tokenizer, gguf_type: str, directory: Path) -> Path:
    from ..core.checkpoints import load
    from ..export.gguf import export_gguf

    out = directory / f"model-{gguf_type}.gguf"
    if not out.exists():
        model, _ = load(checkpoint, device="cpu", dtype=torch.float32)
        export_gguf(model, tokenizer, out, GGUF_TYPE[gguf_type])
    return out


def agreement(tokens: list[int], reference: list[int] | None) -> int | None:
    """How many leading tokens equal the reference's (None without one)."""
    if reference is None:
        return None
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def measure_group(o: PeersBench, group: str, specs: dict[Contender, dict], say) -> tuple[list[dict], dict]:
    """Every contender of one format group loaded in a process of its own, then taking turns."""
    workers, rows, tokens = {}, {}, {}
    try:
        for c, spec in specs.items():
            say(f"{group}: loading {c.engine} {c.label}...")
            w = workers[c] = Worker(f"{c.engine} {c.label}", o.threads)
            try:
                loaded = w.request({"load": spec}, o.load_timeout)
                rows[c] = {"loaded_s": loaded["loaded_s"], "decode": [], "prefill": []}
                rows[c]["eager_tokens"] = loaded.get("eager_tokens")
            except WorkerError as exc:
                rows[c] = {"error": str(exc)}
                w.close()
                del workers[c]
        for r in range(o.rounds):
            order = list(workers)
            order = order[r % len(order) :] + order[: r % len(order)] if order else order  # each goes first in turn
            for c in order:
                try:
                    out = workers[c].request({"run": True}, o.run_timeout)
                except WorkerError as exc:
                    rows[c] = {"error": str(exc)}
                    workers.pop(c).close()
                    continue
                rows[c]["decode"].append((o.new_tokens - 1) / out["decode_s"])
                rows[c]["prefill"].append(out["prefill_s"])
                tokens[c] = out["tokens"]
            say(f"{group}: round {r + 1} of {o.rounds}")
    finally:
        for w in workers.values():
            w.close()
    return [_row(c, rows[c], group, tokens.get(c)) for c in specs], tokens


def _row(c: Contender, r: dict, group: str, tokens: list[int] | None = None) -> dict:
    row = {"group": group, "engine": c.engine, "format": c.label}
    if "error" in r or not r.get("decode"):
        return {**row, "error": r.get("error", "no run finished")}
    row |= {
        "tokens_per_s": statistics.median(r["decode"]),
        "tokens_per_s_runs": r["decode"],
        "prefill_ms": 1e3 * statistics.median(r["prefill"]),
        "loaded_s": r["loaded_s"],
    }
    eager = r.get("eager_tokens")
    n = min(len(eager or ()), len(tokens or ()))
    if n and tokens[:n] != eager[:n]:
        at = agreement(tokens, eager)
        row["invalid"] = f"wrong when compiled (its eager tokens differ from token {at + 1}): not compared"
    return row


def bench_peers(o: PeersBench) -> dict:
    """The figures of ``bench peers`` with their provenance."""

    def say(message: str) -> None:
        if o.progress:
            print(message, file=sys.stderr, flush=True)

    result = provenance(
        torch.device("cpu"),
        threads=o.threads,
        prompt_len=o.prompt_len,
        new_tokens=o.new_tokens,
        rounds=o.rounds,
        compile=o.compile,
        peers={e: _version(PEERS[e][0]) or missing_peer(e) for e in PEERS},
        llama_cpp_build=_llama_cpp_build(),
    )
    rows, reference = [], None
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        checkpoint, tokenizer, prompt, weights = prepare_weights(o, directory)
        result["model"] = weights
        for group in o.formats:
            specs, skipped = {}, {}
            for c in (c for c in CONTENDERS if c.group == group):
                why = missing_peer(c.engine)
                if why is not None:
                    skipped[c] = {"group": group, "engine": c.engine, "format": c.label, "skipped": why}
                    continue
                spec = {"engine": c.engine, "format": c.format, "prompt": prompt, "new_tokens": o.new_tokens}
                spec["compile"] = o.compile and c.engine != "llama.cpp"
                spec["path"] = str(
                    gguf_file(checkpoint, tokenizer, c.format, directory) if c.engine == "llama.cpp" else checkpoint
                )
                specs[c] = spec
            group_rows, tokens = measure_group(o, group, specs, say)
            fp32 = next((t for c, t in tokens.items() if c.engine == "minillm" and c.format == "fp32"), None)
            reference = reference or fp32
            measured = dict(zip(specs, group_rows))
            for c, row in measured.items():
                if c in tokens:
                    row["tokens_agree"] = agreement(tokens[c], reference)
            rows += [measured.get(c) or skipped[c] for c in CONTENDERS if c in measured or c in skipped]
    result["rows"] = rows
    result["summary"] = summary(rows)
    return finish_provenance(result)


def _llama_cpp_build() -> str | None:
    """llama.cpp's own account of the instructions it was built with (its kernels differ by them:
    AVX-512 VNNI, AMX), or None where it is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        import llama_cpp

        return llama_cpp.llama_print_system_info().decode().strip()
    except Exception as exc:  # noqa: BLE001 - a build that cannot say is recorded as such
        return f"unknown ({type(exc).__name__})"


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    dist = {"llama_cpp": "llama-cpp-python"}.get(module, module)
    try:
        return version(dist)
    except PackageNotFoundError:
        return "installed (version unknown)"


def summary(rows: list[dict]) -> list[dict]:
    """Per format group: minillm's fastest row against the fastest peer's (> 1: minillm ahead); a
    row marked invalid (its compiled path decodes other tokens than its eager one) is left out."""
    out = []
    for group in dict.fromkeys(r["group"] for r in rows):
        timed = [r for r in rows if r["group"] == group and "tokens_per_s" in r and "invalid" not in r]
        ours = [r for r in timed if r["engine"] == "minillm"]
        peers = [r for r in timed if r["engine"] != "minillm"]
        if not ours or not peers:
            continue
        best, rival = max(ours, key=lambda r: r["tokens_per_s"]), max(peers, key=lambda r: r["tokens_per_s"])
        out.append(
            {
                "group": group,
                "minillm": f"{best['format']} {best['tokens_per_s']:.1f}",
                "best peer": f"{rival['engine']} {rival['format']} {rival['tokens_per_s']:.1f}",
                "ratio": best["tokens_per_s"] / rival["tokens_per_s"],
            }
        )
    return out


def format_peers(result: dict, groups: Sequence[str] | None = None) -> str:
    """The table of a run, and minillm's fastest against the fastest peer per format; ``groups``:
    only these format groups (e.g. ("fp32",))."""
    if groups is not None:
        keep = set(groups)
        result = {
            **result,
            "rows": [r for r in result["rows"] if r["group"] in keep],
            "summary": [s for s in result["summary"] if s["group"] in keep],
        }
    compiled = ", minillm and torchao compiled" if result.get("compile") else ""
    title = (
        f"Decode tokens/s, {result['model']}, batch 1, {result['prompt_len']}-token prompt, "
        f"{result['new_tokens']} greedy tokens, median of {result['rounds']} rounds taking turns, "
        f"{result['threads']} thread(s) each{compiled}, on {describe(result)}"
    )
    table, notes = [], []
    for r in result["rows"]:
        row = {"group": r["group"], "engine": r["engine"], "weights": r["format"]}
        row |= {"tok/s": "-", "prefill ms": "-", "same tokens": "-", "note": ""}
        if "tokens_per_s" in r:
            agree = r.get("tokens_agree")
            row |= {
                "tok/s": f"{r['tokens_per_s']:.1f}",
                "prefill ms": f"{r['prefill_ms']:.1f}",
                "same tokens": "-" if agree is None else f"{agree}/{result['new_tokens']}",
            }
        note = r.get("invalid") or r.get("skipped") or (f"failed: {r['error']}" if "error" in r else "")
        if note:  # said under the table, by number: the table keeps to the page
            notes.append(f"({len(notes) + 1}) {r['engine']} {r['format']}: {note}")
            row["note"] = f"({len(notes)})"
        table.append(row)
    lines = [format_table(table, title=title)]
    if notes:
        lines[0] += "\n" + "\n".join(textwrap.fill(n, PAGE_WIDTH, subsequent_indent="    ") for n in notes)
    if result["summary"]:
        rows = [{**s, "ratio": f"{s['ratio']:.2f}x"} for s in result["summary"]]
        lines.append(format_table(rows, title="minillm's fastest vs the fastest peer, per format"))
    return "\n\n".join(lines)
