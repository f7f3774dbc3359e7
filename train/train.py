"""Train the small llama that veloxpatch ships for long-context quality evaluation (CPU, resumable).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 OPENBLAS_NUM_THREADS=2 \
        python train/train.py --ckpt-dir /root/veloxpatch-train          # train / resume
    python train/train.py --export                                       # best checkpoint -> veloxpatch/assets/model

Curriculum over context length: a stage advances when held-out passkey accuracy at its length reaches
``--advance-acc``. Tokens per step stay constant (batch = batch_tokens / L). Every ``--eval-every`` steps the run
measures greedy passkey accuracy (held-out seeds, full cache) and exports the best checkpoint automatically.
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import shutil
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "train"))
import build_tokenizer  # noqa: E402
from data import Mix, make_batch  # noqa: E402
from veloxpatch.eval import tasks  # noqa: E402

EXPORT_DIR = ROOT / "veloxpatch" / "assets" / "model"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt-dir", default="/root/veloxpatch-train")
    ap.add_argument("--export", action="store_true", help="export the best checkpoint and exit")
    ap.add_argument("--export-dir", default=str(EXPORT_DIR))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--stages", default="256,512,1024,2048", help="context lengths of the curriculum")
    ap.add_argument("--advance-acc", type=float, default=0.9)
    ap.add_argument("--min-stage-steps", type=int, default=150)
    ap.add_argument("--target-ctx", default="1024,2048", help="lengths the best checkpoint is judged at")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--total-steps", type=int, default=12000, help="length of the cosine schedule")
    ap.add_argument("--max-steps", type=int, default=10**9, help="stop after this step (for experiments)")
    ap.add_argument("--answer-weight", type=float, default=4.0)
    ap.add_argument("--drill", default="0.5,0.3,0.15,0.1", help="share of drill sequences per stage")
    ap.add_argument("--eval-every", type=int, default=150)
    ap.add_argument("--eval-n", type=int, default=32)
    ap.add_argument("--ckpt-every-s", type=float, default=300)
    ap.add_argument("--no-auto-export", action="store_true")
    ap.add_argument("--warm-stage", type=int, default=0,
                    help="curriculum stage (index into --stages) a warm start from the shipped weights begins at")
    return ap.parse_args(argv)


def model_config(args: argparse.Namespace, vocab: int, eos_id: int) -> dict:
    """An mlx_lm / HF style llama config (written verbatim into the exported config.json)."""
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": args.hidden, "num_hidden_layers": args.layers, "intermediate_size": args.ffn,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "rms_norm_eps": 1e-5, "vocab_size": vocab, "rope_theta": 10000.0,
        "max_position_embeddings": max(int(s) for s in args.stages.split(",")),
        "tie_word_embeddings": True, "eos_token_id": eos_id, "torch_dtype": "float16",
    }


def build_model(cfg: dict) -> nn.Module:
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    return model


def lr_at(step, args: argparse.Namespace):
    """Linear warmup, then cosine decay to ``min_lr_frac`` at ``total_steps`` (flat afterwards).

    Works on ints (logging) and on the optimizer's step counter (an mx.array, inside the compiled step)."""
    step = mx.array(step, dtype=mx.float32)
    warm = args.lr * (step + 1) / args.warmup
    t = mx.clip((step - args.warmup) / max(1, args.total_steps - args.warmup), 0.0, 1.0)
    cos = args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + mx.cos(math.pi * t)))
    return mx.where(step < args.warmup, warm, cos)


# ---------------------------------------------------------------- evaluation
def passkey_accuracy(model: nn.Module, tok: Tokenizer, L: int, seeds: range, kind: str = "passkey") -> float:
    """Greedy exact-match accuracy with the full cache: the argmax at every answer position must be the answer
    token (one teacher-forced forward; identical to what greedy decoding would emit)."""
    gen = tasks.passkey_example if kind == "passkey" else tasks.multikey_example
    len_fn = lambda s: len(tok.encode(s).ids)  # noqa: E731
    hits = 0
    for seed in seeds:
        prompt, answer = gen(len_fn, L, seed, "heldout")
        p, a = tok.encode(prompt).ids, tok.encode(answer).ids
        x = mx.array([p + a[:-1]])
        pred = mx.argmax(model(x)[0, len(p) - 1:], axis=-1)
        hits += int(np.array_equal(np.array(pred), np.array(a)))
    return hits / len(seeds)


# ---------------------------------------------------------------- checkpoints
def save_ckpt(d: Path, model: nn.Module, opt: optim.Optimizer, meta: dict) -> None:
    """Atomic: write into a temp dir, then rename over ``latest``."""
    tmp, dst = d / "latest.tmp", d / "latest"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "weights.safetensors"), dict(tree_flatten(model.parameters())))
    opt_flat = {k: v for k, v in tree_flatten(opt.state) if isinstance(v, mx.array)}
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), opt_flat)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    old = d / "latest.old"
    shutil.rmtree(old, ignore_errors=True)
    if dst.exists():
        dst.rename(old)
    tmp.rename(dst)
    shutil.rmtree(old, ignore_errors=True)


def save_best(d: Path, model: nn.Module, meta: dict) -> None:
    tmp, dst = d / "best.tmp", d / "best"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "weights.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


def export(ckpt_dir: Path, out: Path, tok_path: Path) -> None:
    """Write the best checkpoint as a plain mlx_lm model folder (fp16 weights, HF fast-tokenizer files)."""
    best = ckpt_dir / "best"
    meta = json.loads((best / "meta.json").read_text())
    cfg = meta["model_config"]
    weights = {k: v.astype(mx.float16) for k, v in mx.load(str(best / "weights.safetensors")).items()}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.copy(tok_path, tmp / "tokenizer.json")
    eos = build_tokenizer.EOS
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": None, "unk_token": None,
        "pad_token": eos, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": cfg["max_position_embeddings"],
    }, indent=2))
    (tmp / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos, "pad_token": eos}, indent=2))
    (tmp / "training_meta.json").write_text(json.dumps({k: meta[k] for k in meta if k != "model_config"}, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"exported step {meta['step']} ({meta.get('evals', {})}) -> {out}", flush=True)


# ---------------------------------------------------------------- training
def prefetch(tok: Tokenizer, seed: int, mix: Mix, batch_tokens: int, start: int, L: int, q: queue.Queue,
             stop: threading.Event) -> None:
    """Background producer of (step, L, batch); the consumer drops batches whose L is stale."""
    step = start
    while not stop.is_set():
        x, w = make_batch(tok, seed, step, L, max(1, batch_tokens // L), mix)
        while not stop.is_set():
            try:
                q.put((step, L, x, w), timeout=0.5)
                break
            except queue.Full:
                continue
        step += 1


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tok_path = ckpt_dir / "tokenizer.json"
    if not tok_path.exists():
        shipped = Path(args.export_dir) / "tokenizer.json"
        if shipped.exists():
            shutil.copy(shipped, tok_path)
        else:
            build_tokenizer.build().save(str(tok_path))
    if args.export:
        export(ckpt_dir, Path(args.export_dir), tok_path)
        return

    mx.random.seed(args.seed)
    tok = Tokenizer.from_file(str(tok_path))
    cfg = model_config(args, tok.get_vocab_size(), tok.token_to_id(build_tokenizer.EOS))
    model = build_model(cfg)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    opt = optim.AdamW(learning_rate=lambda t: lr_at(t, args), betas=(0.9, 0.95), weight_decay=0.05)
    stages = [int(s) for s in args.stages.split(",")]
    targets = [int(s) for s in args.target_ctx.split(",")]
    meta = {"step": 0, "stage": 0, "stage_start": 0, "best_score": -1.0, "tokens": 0, "model_config": cfg,
            "args": vars(args)}
    latest = ckpt_dir / "latest"
    if (latest / "meta.json").exists():
        meta.update({k: v for k, v in json.loads((latest / "meta.json").read_text()).items() if k != "args"})
        meta["args"] = vars(args)
        model.load_weights(str(latest / "weights.safetensors"))
        opt.init(model.trainable_parameters())
        opt.state = tree_unflatten(list(mx.load(str(latest / "optimizer.safetensors")).items()))
        print(f"resumed from step {meta['step']} stage {meta['stage']}", flush=True)
    elif (Path(args.export_dir) / "model.safetensors").exists():
        model.load_weights(str(Path(args.export_dir) / "model.safetensors"))
        model.update(tree_unflatten([(k, v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())]))
        meta["stage"] = args.warm_stage
        print(f"warm start from shipped weights at L={stages[args.warm_stage]}", flush=True)
    print(f"params {n_params / 1e6:.2f}M, stages {stages}, batch tokens {args.batch_tokens}", flush=True)
    mx.eval(model.parameters(), opt.state)

    def loss_fn(m, x, w):
        logits = m(x[:, :-1]).astype(mx.float32)
        ce = nn.losses.cross_entropy(logits, x[:, 1:], reduction="none")
        return (ce * w).sum() / w.sum(), (ce * (w > 1)).sum() / mx.maximum((w > 1).sum(), 1)

    state = [model.state, opt.state]

    def step_fn(x, w):
        (loss, ans_loss), grads = nn.value_and_grad(model, loss_fn)(model, x, w)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss, ans_loss

    # model + optimizer state flow through `state`; recompiles once per context length
    train_step = mx.compile(step_fn, inputs=state, outputs=state)
    def mix_for(stage: int) -> Mix:
        """Drill share per stage; the rest keeps the default passkey/dense/plain proportions."""
        shares = [float(v) for v in args.drill.split(",")]
        d = shares[min(stage, len(shares) - 1)]
        base = Mix()
        rest = 1 - d
        return Mix(passkey=base.passkey * rest, dense=base.dense * rest, plain=base.plain * rest, drill=d,
                   answer_weight=args.answer_weight)

    log_path = ckpt_dir / "eval.jsonl"
    step, stage = meta["step"], meta["stage"]
    q: queue.Queue = queue.Queue(maxsize=4)
    stop = threading.Event()

    def start_producer(L: int):
        nonlocal q, stop
        stop.set()
        q, stop = queue.Queue(maxsize=4), threading.Event()
        threading.Thread(target=prefetch, args=(tok, args.seed, mix_for(stages.index(L)), args.batch_tokens, step,
                                                L, q, stop),
                         daemon=True).start()

    start_producer(stages[stage])
    last_ckpt, t0, tok_count, losses = time.time(), time.time(), 0, []
    while step < args.max_steps:
        L = stages[stage]
        s, Lb, x, w = q.get()
        assert s == step and Lb == L, (s, step, Lb, L)
        loss, ans_loss = train_step(mx.array(x), mx.array(w))
        mx.eval(state, loss, ans_loss)
        losses.append((loss.item(), ans_loss.item()))
        step += 1
        tok_count += x.shape[0] * L
        meta["tokens"] += x.shape[0] * L
        if step % 25 == 0:
            dt = time.time() - t0
            ls = np.mean(losses, axis=0)
            print(f"step {step} L {L} loss {ls[0]:.3f} ans_loss {ls[1]:.3f} lr {lr_at(step, args).item():.2e} "
                  f"{tok_count / dt:.0f} tok/s", flush=True)
            t0, tok_count, losses = time.time(), 0, []
        if step % args.eval_every == 0:
            te = time.time()
            seeds = range(args.eval_n)
            evals = {f"passkey@{L}": passkey_accuracy(model, tok, L, seeds)}
            for T in targets:
                if T != L and T <= 2 * L:
                    evals[f"passkey@{T}"] = passkey_accuracy(model, tok, T, seeds)
            evals[f"multikey@{L}"] = passkey_accuracy(model, tok, L, range(args.eval_n // 2), "multikey")
            # targets first; curriculum progress (stage, accuracy at its length) only breaks ties, so a usable
            # model is exported before the run reaches the target lengths
            score = sum(evals.get(f"passkey@{T}", 0.0) for T in targets) + 1e-3 * (stage + evals[f"passkey@{L}"])
            rec = {"step": step, "stage_L": L, "tokens": meta["tokens"], "time": time.time(), **evals,
                   "score": score, "eval_s": round(time.time() - te, 1)}
            print("EVAL", json.dumps(rec), flush=True)
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            meta.update(step=step, stage=stage)
            if score > meta["best_score"]:
                meta["best_score"] = score
                save_best(ckpt_dir, model, {**meta, "evals": evals})
                if not args.no_auto_export:
                    export(ckpt_dir, Path(args.export_dir), tok_path)
            if (evals[f"passkey@{L}"] >= args.advance_acc and stage + 1 < len(stages)
                    and step - meta["stage_start"] >= args.min_stage_steps):
                stage += 1
                meta.update(stage=stage, stage_start=step)
                print(f"advance to L={stages[stage]}", flush=True)
                start_producer(stages[stage])
        if time.time() - last_ckpt > args.ckpt_every_s or step == args.max_steps:
            meta.update(step=step, stage=stage)
            save_ckpt(ckpt_dir, model, opt, meta)
            last_ckpt = time.time()
    stop.set()


if __name__ == "__main__":
    main()
