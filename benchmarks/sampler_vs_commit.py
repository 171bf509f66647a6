"""The GRPO workload on this tree (paged KV cache) against a git worktree of another commit
(that commit's sampler with ``--base_kv_cache``: dense by default), in separate processes.

  python benchmarks/sampler_vs_commit.py --commit b816cf4            # the full workload
  python benchmarks/sampler_vs_commit.py --commit b816cf4 --quick    # a small one
  python benchmarks/sampler_vs_commit.py --tree /path/to/checkout    # an existing checkout
  python benchmarks/sampler_vs_commit.py --paged_decode in_place      # this tree decoding in place
  python benchmarks/sampler_vs_commit.py --commit abcae6e --base_kv_cache paged  # paged vs paged

Workload (``grpo_requests``, shared with benchmarks/sampler.py): ``--prompts`` random prompts
(32) of ``--prompt_len`` tokens (512), each sampled G = ``--group`` (8) times, submitted
together first come first served, temperature 1.0, a seed per sample, up to ``--max_new``
(256) new tokens ending on any of a few stop ids (the scheduler cannot know the lengths).
``--quick``: 8 prompts of 256 tokens, G = 8, up to 64 new tokens.

Each side is one long-lived worker process (this file with ``--serve``) importing ``meshrl``
from its own tree: it builds the tiny Llama-shaped model of benchmarks/sampler.py (same seed,
so the same weights), a sampler, times its first ``generate`` of the workload (compiling on
first use: ``first_call_s``) as the warm-up, then runs the workload once per request of the
driver. Rounds are interleaved (one side, then the other, the order rotating), and only one
side runs at a time. Figures: ``speedup`` (this tree's tokens/s over the commit's, paired round
by round) with its ``_spread`` [min, max], each side's tokens/s, ``prompt_kv_per_group``: the
pages holding live prompts with the slots full of admitted requests over the same prompts held
one copy per sample (from the page pool: 1 / G when every group shares its prompt), each side's
``compiled_programs`` and ``first_call_s``. Last line: one JSON object.

A created worktree is removed at the end (``git worktree remove``); ``--tree`` is never touched.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import numpy as np

SLOTS, DECODE_CHUNK, PAGE_SIZE = 32, 16, 16
STOPS = tuple(range(3, 11))  # stop ids: about 1 in 128 tokens ends a sample
FULL = dict(prompts=32, prompt_len=512, group=8, max_new=256)
QUICK = dict(prompts=8, prompt_len=256, group=8, max_new=64)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def grpo_requests(prompts: int, prompt_len: int, group: int, max_new: int, seed: int = 0
                  ) -> list:
    """``prompts`` x ``group`` sampled requests, a group's samples next to each other."""
    from meshrl.inference.sampler import Request

    rng = np.random.default_rng(seed)
    prompts_NxP = rng.integers(STOPS[-1] + 1, 1024, size=(prompts, prompt_len))
    return [Request(p.tolist(), max_new_tokens=max_new, temperature=1.0, seed=g * group + i,
                    stop_ids=STOPS) for g, p in enumerate(prompts_NxP) for i in range(group)]


def _serve(kv_cache: str, work: dict, paged_decode: str) -> None:
    """Worker: build, warm up (timed: first_call_s), then one timed run per "run" line; "share"
    (after the timed rounds: its extra run is no one's warm-up) answers the prompt page share."""
    import jax

    from meshrl.configs.schema import MeshConfig, ModelConfig, SamplerConfig
    from meshrl.inference.sampler import Sampler
    from meshrl.mesh import create_mesh
    from meshrl.models import create_model, split_model

    # benchmarks/sampler.py's model, spelled out: the baseline tree's copy may differ.
    CFG = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_layers=4,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=2048)
    params = split_model(create_model(CFG, seed=0))[1]
    paged = (dict(kv_cache="paged", page_size=PAGE_SIZE, paged_decode=paged_decode)
             if kv_cache == "paged" else {})
    cfg = SamplerConfig(max_len=work["prompt_len"] + work["max_new"], slots=SLOTS,
                        max_new_tokens=work["max_new"], decode_chunk=DECODE_CHUNK,
                        prompt_buckets=(work["prompt_len"],), **paged)
    reqs = grpo_requests(**work)
    mesh = create_mesh(MeshConfig(data=1, tensor=1), jax.devices()[:1])
    t = time.perf_counter()
    sampler = Sampler(CFG, cfg, mesh, params)
    sampler.generate(reqs, longest_first=False)
    print(json.dumps({"first_call_s": round(time.perf_counter() - t, 2)}), flush=True)
    for line in sys.stdin:
        if line.strip() == "share":
            share = _prompt_share(sampler, reqs) if paged else 1.0
            print(json.dumps({"prompt_kv_per_group": share}), flush=True)
            continue
        if line.strip() != "run":
            break
        t = time.perf_counter()
        outs = sampler.generate(reqs, longest_first=False)
        dt = time.perf_counter() - t
        print(json.dumps({"s": dt, "tokens": sum(len(c.tokens) for c in outs),
                          "compiled_programs": sampler.compile_count()}), flush=True)


def prompt_pages(sampler, reqs: list) -> tuple[int, int]:
    """(pages holding the live prompts, the same prompts one copy per sample) once a paged
    ``sampler`` has admitted the first ``SLOTS`` of ``reqs``, none finished yet (no stop ids,
    two chunks' budget: a round read back right away would free a stopped one's pages); it
    then runs them to the end."""
    budget = 2 * sampler.cfg.decode_chunk
    for r in reqs[:SLOTS]:
        sampler.submit(dataclasses.replace(r, stop_ids=(), max_new_tokens=budget))
    sampler.step()
    live = [c for c in sampler.slots.out if c is not None]
    shared = sampler.pages.prompt_pages(sampler.slots.out)
    while sampler.has_work():
        sampler.step()
    return shared, len(live) * -(-len(reqs[0].prompt_ids) // sampler.cfg.page_size)


def _prompt_share(sampler, reqs: list) -> float:
    """Prompt pages shared over unshared with the slots full of admitted requests."""
    shared, unshared = prompt_pages(sampler, reqs)
    return round(shared / unshared, 4)


@contextlib.contextmanager
def _worktree(commit: str, tree: str | None) -> Iterator[str]:
    """A checkout of ``commit`` named ``meshrl`` (so its parent on PYTHONPATH imports it)."""
    if tree:
        yield tree
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "meshrl")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", path, commit],
                       check=True, capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", path],
                           check=False, capture_output=True)


class Worker:
    """One ``--serve`` process importing ``meshrl`` from ``tree``."""

    def __init__(self, tree: str, kv_cache: str, work: dict, paged_decode: str = "auto"):
        link = tempfile.mkdtemp()
        os.symlink(os.path.abspath(tree), os.path.join(link, "meshrl"))
        env = dict(os.environ, PYTHONPATH=link + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", kv_cache, "--work",
             json.dumps(work), "--paged_decode", paged_decode], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env, text=True, cwd=link)
        self.info = self._reply()

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.args} exited with {self.proc.wait()}")
        return json.loads(line)

    def run(self, what: str = "run") -> dict:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--commit", default="b816cf4", help="the baseline commit")
    ap.add_argument("--tree", help="an existing checkout of the baseline (instead of --commit)")
    ap.add_argument("--rounds", type=int, default=3, help=">= 3 interleaved rounds")
    ap.add_argument("--quick", action="store_true", help=f"the small workload {QUICK}")
    for k, v in FULL.items():
        ap.add_argument(f"--{k}", type=int, help=f"default {v} ({QUICK[k]} with --quick)")
    ap.add_argument("--paged_decode", default="auto", choices=("auto", "window", "in_place"),
                    help="this tree's sampler.paged_decode")
    ap.add_argument("--base_kv_cache", default="dense", choices=("dense", "paged"),
                    help="the baseline's sampler.kv_cache (paged: a commit that has it)")
    ap.add_argument("--serve", choices=("dense", "paged"), help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return _serve(args.serve, json.loads(args.work), args.paged_decode)
    if args.rounds < 3:
        ap.error(f"--rounds must be >= 3, got {args.rounds}")
    work = {k: getattr(args, k) or (QUICK if args.quick else FULL)[k] for k in FULL}
    from meshrl.benchmarks.figures import emit, paired_ratios, spread

    with _worktree(args.commit, args.tree) as base_tree:
        sides = {"base": Worker(base_tree, args.base_kv_cache, work),
                 "this": Worker(REPO, "paged", work, args.paged_decode)}
        runs: dict[str, list[dict]] = {k: [] for k in sides}
        for i in range(args.rounds):
            for name in list(sides)[i % 2:] + list(sides)[:i % 2]:
                runs[name].append(sides[name].run())
                print(f"  round {i} {name}: {runs[name][-1]}", flush=True)
        share = sides["this"].run("share")["prompt_kv_per_group"]
        for w in sides.values():
            w.close()
    tok_s = {k: [r["tokens"] / r["s"] for r in v] for k, v in runs.items()}
    emit({"benchmark": "sampler_vs_commit", "commit": args.tree or args.commit, **work,
          "paged_decode": args.paged_decode, "base_kv_cache": args.base_kv_cache,
          **spread("speedup", paired_ratios(tok_s["this"], tok_s["base"]), 3),
          **spread("base_tok_s", tok_s["base"], 1), **spread("this_tok_s", tok_s["this"], 1),
          "prompt_kv_per_group": share,
          **{f"{k}_first_call_s": w.info["first_call_s"] for k, w in sides.items()},
          **{f"{k}_compiled_programs": runs[k][-1]["compiled_programs"] for k in sides},
          "rounds": args.rounds, "quick": args.quick})


if __name__ == "__main__":
    main()
