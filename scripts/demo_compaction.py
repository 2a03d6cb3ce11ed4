"""Demo of the compaction engine and the episode contract, no model involved.

A scripted agent plays one memory-chain episode (the oracle's commands, the oracle's summaries) with the
project's tokenizer; compaction is forced at the suite's schedule. Prints each segment as a strip of
provenance letters with its loss mask, then validates and saves the batch as the episode contract's file.

    python scripts/demo_compaction.py [--length 12] [--out runs/demo/episodes.pt]

With ``--chat --model DIR`` (a local checkpoint with a chat template, e.g. from scripts/import_checkpoint.py)
the episode is rendered through the tokenizer's chat template (``prompt.format: chat``, :class:`crl.chat.ChatFormat`)
and each segment is also printed as text; still scripted, the model's weights are not loaded.

    python scripts/demo_compaction.py --chat --model checkpoints/smollm2-135m-instruct
"""
from __future__ import annotations

import argparse

from crl.collectors import play_oracle_episode
from crl.compaction import CompactionConfig, CompactionEngine
from crl.envs import MemoryChainSuite
from crl.episode import Provenance, build_episode, save_episodes, validate_episodes
from crl.modules.tokenizer import encode as project_encode, load_tokenizer
from crl.prompts import EOS

LETTER = {
    Provenance.SYSTEM: "s", Provenance.TASK: "u", Provenance.OBSERVATION: "o", Provenance.ACTION: "A",
    Provenance.SUMMARY_INSTRUCTION: "q", Provenance.SUMMARY: "S", Provenance.RESUME_TEMPLATE: "r",
    Provenance.COPIED_SUMMARY: "c", Provenance.COPIED_TAIL: "t", Provenance.COPIED_ACTION: "a",
    Provenance.FROZEN_SUMMARY: "F", Provenance.PADDING: " ",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=12, help="memory-chain distractor steps")
    parser.add_argument("--out", default="runs/demo/episodes.pt", help="where to save the episode batch")
    parser.add_argument("--chat", action="store_true", help="render through the chat template of --model's tokenizer")
    parser.add_argument("--model", help="local checkpoint directory (its tokenizer and chat template), with --chat")
    args = parser.parse_args()
    if args.chat != bool(args.model):
        parser.error("--chat and --model DIR go together")

    fmt, text = None, None
    if args.chat:
        from crl.chat import ChatFormat, load_chat_tokenizer

        tok = load_chat_tokenizer(args.model)
        fmt = ChatFormat(tok)
        encode, eos, text = fmt.encode, fmt.stop_id, (lambda ids: tok.decode(ids))
    else:
        encode, eos = project_encode, load_tokenizer().convert_tokens_to_ids(EOS)
    suite = MemoryChainSuite(length=args.length)
    task = suite.tasks("train")[0]
    env = suite.make_env(task)
    engine = CompactionEngine(
        CompactionConfig(context_capacity=4096, min_remaining=256, max_summary_tokens=16, forced_steps=env.compaction_steps,
                         keep_recent=env.keep_recent),
        encode,
        eos_id=eos,
        prompt_format=fmt,
    )
    ctx = engine.start(env.reset())
    status, reward = play_oracle_episode(env, ctx, encode, eos, lambda env, ctx: (encode(env.oracle_summary()) + [eos], False),
                                         log_prob=-0.1)
    td = build_episode(ctx.segments(), rollout_id=0, reward=reward, status=status)
    validate_episodes(td)
    print(f"task {task.task_id}: {ctx.n_steps} steps, {ctx.n_compactions} compactions, reward {reward}")
    print("legend: " + "  ".join(f"{v}={k.name.lower()}" for k, v in LETTER.items() if k != Provenance.PADDING))
    print("        (upper case = sampled; '^' marks loss-mask 1)")
    for s in range(td.batch_size[0]):
        n = int(td["attention_mask"][s].sum())
        kind = "execution" if int(td["segment_kind"][s]) == 0 else "summary"
        strip = "".join(LETTER[Provenance(int(p))] for p in td["provenance"][s, :n])
        mask = "".join("^" if m else " " for m in td["loss_mask"][s, :n].tolist())
        print(f"[{s}] {kind:9s} n_opt={int(td['loss_mask'][s].sum()):3d} n_after={int(td['n_after'][s]):3d}")
        print(f"    {strip}\n    {mask}")
        if text is not None:
            print("    " + text(td["tokens"][s, :n].tolist()).replace("\n", "\n    "))
    save_episodes(td, args.out)
    print(f"saved {td.batch_size[0]} segments to {args.out}")


if __name__ == "__main__":
    main()
