"""TTT training-step throughput of the SmolLM2-sized draft (fp32, batch 1, L=7), eaglet vs a dense baseline.

    .venv/bin/python benchmarks/ttt_throughput.py [--lengths 512 1024] [--draft-vocab 8192 32000] [--repeats 3]

One step = teacher from the target's final hidden states (full-vocab lm_head), 7 unrolled draft steps,
backward, AdamW update, on a sequence whose first 37% is prompt (unsupervised), as in the embedded run. The baseline, measured in
the same run on the same shapes, is the straightforward form that builds a dense [T, (k+1)T] masked score
matrix at every step k (the approach of SpecForge's trainer); the script prints eaglet's rate over it.
"""

from __future__ import annotations

import argparse
import time

import torch

import models.ttt as ttt
from models.eagle3 import Eagle3Config, Eagle3Draft
from models.teacher import teacher_from_hidden
from models.ttt import TTTBatch, ttt_forward

PROMPT_SHARE = 0.37  # unsupervised share of tokens in the embedded run's train features (1 - 8154/12936)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, vocab_size=49152,
               target_hidden_size=576, aux_layer_ids=[1, 14, 26])


def dense_attend(queries, keys0, values0, diagonal_keys, diagonal_values):
    """Baseline: all keys so far concatenated, one dense boolean mask per step."""
    groups = queries.shape[1] // keys0.shape[1]
    keys = torch.cat([keys0, *diagonal_keys], dim=2).repeat_interleave(groups, 1)
    values = torch.cat([values0, *diagonal_values], dim=2).repeat_interleave(groups, 1)
    length = queries.shape[2]
    blocks = [torch.ones(length, length, dtype=torch.bool).tril()]
    blocks += [torch.eye(length, dtype=torch.bool)] * len(diagonal_keys)
    return torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=torch.cat(blocks, dim=1))


def tokens_per_second(draft: Eagle3Draft, lm_head: torch.Tensor, length: int, repeats: int) -> float:
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-4)
    hidden = torch.randn(1, length, 576)
    timings = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        probs, top1, in_draft = teacher_from_hidden(hidden, lm_head, draft.t2d)
        mask = torch.ones(1, length, dtype=torch.long)
        mask[:, : int(length * PROMPT_SHARE)] = 0
        batch = TTTBatch(torch.randint(0, 49152, (1, length)), mask, torch.randn(1, length, 3 * 576), probs, top1, in_draft)
        optimizer.zero_grad()
        ttt_forward(draft, batch, steps=7).loss.backward()
        optimizer.step()
        timings.append(time.perf_counter() - started)
    return length / min(timings[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--draft-vocab", type=int, nargs="+", default=[8192, 32000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    lm_head = torch.randn(49152, 576) * 0.02
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, fp32, batch 1, L=7")
    fused = ttt.causal_plus_diagonal_attention
    for vocab in args.draft_vocab:
        draft = Eagle3Draft(Eagle3Config(draft_vocab_size=vocab, **SMOLLM2))
        draft.attach_embedding(torch.randn(49152, 576) * 0.02)
        t2d = torch.zeros(49152, dtype=torch.bool)
        t2d[:vocab] = True
        draft.set_vocab_mapping(torch.zeros(vocab, dtype=torch.int64), t2d)
        for length in args.lengths:
            ttt.causal_plus_diagonal_attention = fused
            ours = tokens_per_second(draft, lm_head, length, args.repeats)
            ttt.causal_plus_diagonal_attention = dense_attend
            dense = tokens_per_second(draft, lm_head, length, args.repeats)
            ttt.causal_plus_diagonal_attention = fused
            print(f"Vd={vocab:>5} T={length:>5}: eaglet {ours:7.1f} tok/s, dense baseline {dense:7.1f} tok/s "
                  f"-> {ours / dense:.2f}x")


if __name__ == "__main__":
    main()
