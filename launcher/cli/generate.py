"""`moetron generate RUN_OR_CHECKPOINT (--prompt TEXT | --prompt-ids 1,2,3) [model.key=value ...]`:
sample with a KV cache."""

from __future__ import annotations

import sys
import time

from moetron.launcher.cli.args import add_checkpoint_arguments, add_device_argument, device_of
from moetron.launcher.cli.help import HelpFormatter
from moetron.launcher.perf import display


def register(sub) -> None:
    p = sub.add_parser(
        "generate", help="continue a prompt with a trained model",
        description="Continue a prompt with the model of a checkpoint: one prefill over the prompt, "
                    "then one token per step from the KV cache. RUN_OR_CHECKPOINT is a run folder "
                    "(its newest complete checkpoint is used) or a checkpoint folder. The tokenizer is "
                    "the run's (or a tokenizer.json beside a converted checkpoint). MoE layers run "
                    "dropless. Stops after --max-new-tokens or the end-of-text token. model.key=value "
                    "overrides change settings that hold no weights, e.g. a longer context with "
                    "`model.max_seq_len=4096 model.rope_scaling=yarn model.rope_scaling_factor=4`.",
        formatter_class=HelpFormatter)
    add_checkpoint_arguments(p)
    p.add_argument("--prompt", default=None, metavar="TEXT", help="prompt text, encoded with the run's tokenizer")
    p.add_argument("--prompt-ids", default=None, metavar="IDS", help="prompt as token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate at most")
    p.add_argument("--greedy", action="store_true", help="take the most likely token (ignores the sampling options)")
    p.add_argument("--temperature", type=float, default=1.0, help="divide logits by this; 0 means greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0: all")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the fewest most likely tokens holding this much probability")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-text token")
    add_device_argument(p)
    p.add_argument("--json", action="store_true", help='print {"ids": [new token ids], "text": new text}')
    p.set_defaults(run=run)


def run(args) -> int:
    import json

    import torch

    from moetron.launcher.checkpoint.weights import checkpoint_tokenizer, load_model, resolve_checkpoint
    from moetron.launcher.config import ConfigError
    from moetron.model.generate import Sampling, generate

    if (args.prompt is None) == (args.prompt_ids is None):
        raise ConfigError("give exactly one of --prompt TEXT and --prompt-ids 1,2,3")
    if args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be >= 0")
    sampling = Sampling(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    for key, value, rule in sampling.problems():
        raise ConfigError(f"--{key.replace('_', '-')} {value}: {rule}")
    prompt_ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    device = device_of(args)

    ckpt = resolve_checkpoint(args.path)
    cfg, model = load_model(ckpt, device=device, overrides=args.overrides)
    try:
        tok = checkpoint_tokenizer(ckpt, cfg)
    except FileNotFoundError:
        if prompt_ids is None:
            raise
        tok = None
    if prompt_ids is None:
        prompt_ids = tok.encode(args.prompt)
    if not prompt_ids:
        raise ConfigError("the prompt is empty")
    vocab = cfg.model.vocab_size
    bad = [i for i in prompt_ids if not 0 <= i < vocab]
    if bad:
        raise ConfigError(f"--prompt-ids: {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    n = len(prompt_ids)
    total = n + args.max_new_tokens
    if total > cfg.model.max_seq_len:
        raise ConfigError(f"prompt ({n} token{'s' * (n != 1)}) + --max-new-tokens ({args.max_new_tokens}) = {total}: "
                          f"exceeds the model's max_seq_len ({cfg.model.max_seq_len})")

    generator = torch.Generator(device=device).manual_seed(args.seed)
    eos = None if args.ignore_eos or tok is None else tok.eos_id
    clock = DecodeClock(device)
    hook = model.register_forward_pre_hook(clock.forward_starts)
    new_ids = generate(model, torch.tensor([prompt_ids]), args.max_new_tokens, sampling, generator=generator,
                       eos_id=eos, vocab_size=tok.vocab_size if tok is not None else None)[0].tolist()
    speed = clock.summary(len(new_ids))
    hook.remove()
    text = tok.decode(new_ids) if tok is not None else None
    if args.json:
        print(json.dumps({"ids": new_ids, "text": text}))
    else:
        print((tok.decode(prompt_ids) + text) if tok is not None else " ".join(map(str, prompt_ids + new_ids)))
    if speed:  # on stderr: stdout stays the text (or the JSON) alone, for pipes
        print(speed, file=sys.stderr)
    return 0


class DecodeClock:
    """Times a decode by the model's forward calls: the first is the prompt's prefill, and each
    later one starts as soon as a token was chosen, so the second one's start is the time to the
    first token and the rest of the tokens came at the decode rate."""

    def __init__(self, device):
        self.device, self.starts = device, []
        self.t0 = self.now()

    def now(self) -> float:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # NOTE: host-device sync, so the times are the device's
        return time.perf_counter()

    def forward_starts(self, *_) -> None:
        self.starts.append(self.now())

    def summary(self, new_tokens: int) -> str:
        """'12 new tokens in 0.41 s: first after 0.052 s, then 30 tok/s' ('' for none)."""
        if new_tokens == 0:
            return ""
        end = self.now()
        first = self.starts[1] if len(self.starts) > 1 else end
        noun = "token" if new_tokens == 1 else "tokens"
        line = f"{new_tokens} new {noun} in {end - self.t0:.2f} s: first after {first - self.t0:.3f} s"
        if new_tokens > 1:
            line += f", then {display.tokens_per_s((new_tokens - 1) / max(end - first, 1e-9))}"
        return line


def _parse_ids(raw: str) -> list[int]:
    from moetron.launcher.config import ConfigError

    try:
        return [int(x) for x in raw.replace(" ", "").split(",") if x]
    except ValueError:
        raise ConfigError(f"--prompt-ids {raw!r}: expected comma-separated integers, e.g. 1,2,3") from None
