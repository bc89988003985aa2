"""A tiny, locally built causal LM (or reward model) and tokenizer for tests, demos, benchmarks.

No model hub is needed: `build_tiny_model` trains a byte-level BPE tokenizer on a synthetic
corpus (small arithmetic such as ``12+7=19`` and plain words), builds a Qwen2 causal LM
(tied embeddings, about 1M parameters at the defaults) and saves both with
``save_pretrained``, so ``AutoModelForCausalLM.from_pretrained(dir)`` and
``AutoTokenizer.from_pretrained(dir)`` load it offline. The tokenizer has a plain chat template
(`CHAT_TEMPLATE`). With ``head="score"`` the same body gets
a scalar head instead (``Qwen2ForSequenceClassification``, ``num_labels=1``: a reward model that
``AutoModelForSequenceClassification`` loads), with random weights.

Guarantees:
- Deterministic: the same arguments give byte-identical weights and tokenizer files.
- The tokenizer pipeline is exactly Qwen2's (NFC, Qwen2 split regex with single digits,
  byte-level BPE), so the raw ``tokenizers`` object and the class ``AutoTokenizer`` picks for a
  ``qwen2`` model encode every text identically.
- Cache-friendly: a manifest of the build spec is written last; a directory whose manifest
  matches is reused as is. The spec includes the versions of the libraries the bytes depend on
  (`build_versions`: torch, transformers, tokenizers), so a model cached by another install is
  rebuilt, never silently reused. A fresh directory is built aside and renamed into place, so a
  concurrent builder never sees a half-written model.

Corpora (`CORPORA`): ``mixed`` (the default) as above; ``arithmetic`` holds only
``a<op>b=c`` lines with single-digit operands, so a short warm-up on it teaches the answer format
of small arithmetic prompts quickly (short lines) while leaving most answers unknown;
``tool_calls`` teaches the format of a calculator call on two-digit sums (`tool_call_line`), not
the habit of calling: most of its lines answer directly, with a random number.

CLI: ``python -m flowrl.tiny_model OUT_DIR [--seed N] [--pretrain-steps N] [--pretrain-until S]
[--corpus KIND] [--head lm|score] [--json-progress]`` (and the shape: ``--vocab-size``,
``--hidden``, ``--layers``, ``--heads``, ``--kv-heads``, ``--max-positions``). It says what it
builds on stderr; SIGINT or SIGTERM stop it with exit code 130, leaving nothing that looks built.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

MANIFEST = "flowrl-tiny.json"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
CorpusKind = Literal["mixed", "arithmetic", "tool_calls"]
CORPORA: tuple[CorpusKind, ...] = ("mixed", "arithmetic", "tool_calls")
"""The built-in corpora `synthetic_corpus` generates (see the module docstring)."""
#: called with what a build is doing (`BUILD_STAGES`) and its figures, e.g.
#: ``("warmup", {"step": 3, "steps": 200})``
BuildProgress = Callable[[str, dict[str, Any]], None]
BUILD_STAGES = ("tokenizer", "model", "warmup", "save")
"""What a build reports, in order: ``tokenizer`` (trained; ``tokens``), ``model`` (made;
``parameters``), ``warmup`` (each warm-up step done; ``step``, ``steps``), ``save`` (writing)."""
HeadKind = Literal["lm", "score"]
HEADS: tuple[HeadKind, ...] = ("lm", "score")
"""What sits on the transformer body: the language-modelling head or one scalar score."""
#: the build procedure's version: bumped when it changes, so cached directories are rebuilt
#: (and `flowrl.run.tiny_model_dir` keys its cache with it from 2 on). 2: the tokenizer has a
#: chat template.
BUILD_FORMAT = 2
# The libraries whose versions the built bytes may depend on (tokenizer training, weight
# initialisation, the warm-up's kernels).
_BUILD_LIBRARIES = ("torch", "transformers", "tokenizers")

# Qwen2's pre-tokenizer split: every digit is its own pre-token, which suits arithmetic.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_WORDS = (
    "the", "a", "an", "and", "or", "but", "if", "then", "else", "when", "while", "of", "to", "in",
    "on", "at", "by", "for", "with", "from", "up", "down", "over", "under", "into", "out", "is",
    "are", "was", "were", "be", "been", "being", "have", "has", "had", "do", "does", "did", "can",
    "could", "will", "would", "shall", "should", "may", "might", "must", "not", "no", "yes",
    "all", "any", "some", "many", "much", "more", "most", "few", "one", "two", "three", "four",
    "five", "six", "seven", "eight", "nine", "ten", "zero", "plus", "minus", "times", "equals",
    "sum", "answer", "number", "question", "what", "which", "who", "how", "why", "where", "add",
    "subtract", "multiply", "result", "total", "value", "cat", "dog", "fox", "bird", "fish",
    "tree", "sun", "moon", "star", "sky", "sea", "river", "hill", "road", "house", "door",
    "window", "book", "pen", "cup", "bowl", "table", "chair", "apple", "bread", "milk", "water",
    "fire", "stone", "wood", "iron", "gold", "red", "green", "blue", "black", "white", "big",
    "small", "long", "short", "fast", "slow", "hot", "cold", "old", "new", "good", "bad", "happy",
    "sad", "quick", "lazy", "brown", "jumps", "runs", "walks", "reads", "writes", "sees", "finds",
    "makes", "takes", "gives", "keeps", "counts",
)
_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st",
           "tr", "pl", "ch", "sh", "th", "gr", "br")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "oo")
_CODAS = ("", "", "n", "r", "s", "t", "l", "nd", "st", "ng", "ck")


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines the built files; its JSON is the cache manifest."""

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int
    seed: int
    corpus_sha256: str
    pretrain_steps: int
    libraries: dict[str, str]
    format: int = BUILD_FORMAT
    head: HeadKind = "lm"
    pretrain_until: float | None = None

    def manifest(self) -> dict[str, Any]:
        """The spec as the manifest records it; a causal LM's leaves ``head`` out, and a
        warm-up of a fixed length leaves ``pretrain_until`` out, so the models cached before
        either existed stay valid."""
        out = asdict(self)
        if self.head == "lm":
            del out["head"]
        if self.pretrain_until is None:
            del out["pretrain_until"]
        return out


def installed_versions(names: Iterable[str]) -> dict[str, str]:
    """Each distribution's installed version, ``absent`` when it is not installed."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def build_versions() -> dict[str, str]:
    """The installed versions of the libraries a build depends on (part of its spec)."""
    return installed_versions(_BUILD_LIBRARIES)


def arithmetic_line(rng: random.Random, max_operand: int = 99) -> str:
    """One ``a<op>b=c`` line over non-negative operands (``-`` never goes below zero)."""
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    op = rng.choice("+-*")
    if op == "-" and b > a:
        a, b = b, a
    result = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a}{op}{b}={result}"


#: the share of `tool_call_line` lines that call the calculator (the rest answer directly)
TOOL_CALL_SHARE = 0.5


def tool_call_line(rng: random.Random, max_operand: int = 99,
                   call_share: float = TOOL_CALL_SHARE) -> str:
    """One episode of the calculator task as text: ``a+b=`` and either a direct answer, a
    random number (``37+45=113``: right by chance only), or, with probability ``call_share``,
    a call, its result as the tiny chat template renders a ``tool`` message after a turn, and
    the answer copied from it (``37+45= CALL add 37 45<|endoftext|>\ntool: 82\n82``).

    Each part starts at a pre-token boundary, so the line tokenizes to what an episode that
    tokenizes the prompt, the tool message and the turns apart holds (``recipes/tool_cpu.py``)."""
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if rng.random() >= call_share:
        return f"{a}+{b}={rng.randint(0, 2 * max_operand)}"
    return f"{a}+{b}= CALL add {a} {b}{EOS_TOKEN}\ntool: {a + b}\n{a + b}"


def synthetic_corpus(
    seed: int = 0, *, lines: int = 6000, kind: CorpusKind = "mixed"
) -> list[str]:
    """``mixed``: arithmetic lines, sentences of common words and syllable pseudo-words (for
    merges). ``arithmetic``: only `arithmetic_line` lines with operands ``0..9``."""
    if kind not in CORPORA:
        raise ValueError(f"unknown corpus {kind!r}; have {list(CORPORA)}")
    rng = random.Random(seed)
    if kind == "arithmetic":
        return [arithmetic_line(rng, max_operand=9) for _ in range(lines)]
    if kind == "tool_calls":
        return [tool_call_line(rng) for _ in range(lines)]
    out: list[str] = []
    for i in range(lines):
        if i % 3 == 0:
            out.append(arithmetic_line(rng))
        elif i % 3 == 1:
            out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 10))))
        else:
            words = [
                "".join(
                    rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                    for _ in range(rng.randint(1, 3))
                )
                for _ in range(rng.randint(3, 8))
            ]
            out.append(" ".join(words))
    return out


def _corpus_digest(corpus: Sequence[str]) -> str:
    h = hashlib.sha256()
    for line in corpus:
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()


def _train_tokenizer(corpus: Sequence[str], vocab_size: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def answer_pairs(corpus: Iterable[str]) -> list[tuple[str, str]]:
    """The corpus's distinct ``question=answer`` lines split after the first ``=`` (lines
    without one, or with nothing after it, have no answer to know), in first-seen order."""
    seen: dict[tuple[str, str], None] = {}
    for line in corpus:
        question, eq, answer = line.partition("=")
        if eq and answer and EOS_TOKEN not in answer:
            seen[(question + eq, answer)] = None
    return list(seen)


def _padded(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Any, Any]:
    """Token rows as one right-padded batch: (ids, attention mask)."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return ids, mask


def known_share(model: Any, tokenizer: Any, pairs: Sequence[tuple[str, str]]) -> float:
    """The share of ``pairs`` whose greedy completion of the question is exactly the answer and
    then the end of text: every answer token, and the end, is the most likely one after the
    question and the answer's earlier tokens (one batched forward pass, no sampling)."""
    import torch

    if not pairs:
        return 0.0
    rows, starts = [], []
    for question, answer in pairs:
        asked = tokenizer(question).input_ids
        row = [*tokenizer(question + answer).input_ids, tokenizer.eos_token_id]
        if row[:len(asked)] != asked:  # the answer merged into the question's last token
            raise ValueError(f"{question + answer!r} does not tokenize as its question "
                             "then its answer")
        rows.append(row)
        starts.append(len(asked))
    ids, mask = _padded(rows, tokenizer.pad_token_id)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        best = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
    model.train(was_training)
    known = sum(
        bool((best[i, start - 1:len(r) - 1] == ids[i, start:len(r)]).all())
        for i, (r, start) in enumerate(zip(rows, starts, strict=True)))
    return known / len(rows)


#: how often (steps) a warm-up with a target (``pretrain_until``) checks what the model knows
KNOWN_EVERY = 100


def _pretrain(model: Any, tokenizer: Any, corpus: Sequence[str], steps: int, seed: int,
              progress: BuildProgress, until: float | None = None) -> None:
    """A short language-modelling warm-up on the corpus, so the model knows its formats.
    ``until``: stop early, at a multiple of `KNOWN_EVERY` steps, once the model answers that
    share of the corpus's questions exactly (`known_share`)."""
    import torch

    rng = random.Random(seed)
    encoded = [[*tokenizer(line).input_ids, tokenizer.eos_token_id] for line in corpus]
    pairs = answer_pairs(corpus) if until is not None else []
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(1, steps + 1):
        ids, mask = _padded([rng.choice(encoded) for _ in range(32)], tokenizer.pad_token_id)
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if until is not None and step % KNOWN_EVERY == 0:
            known = known_share(model, tokenizer, pairs)
            progress("warmup", {"step": step, "steps": steps, "known": known})
            if known >= until:
                break
        else:
            progress("warmup", {"step": step, "steps": steps})
    model.eval()


#: a plain chat template (``role: content`` lines, then ``assistant: ``), so that prompts
#: through a chat template (``data.chat_template``) can be tried on the tiny model
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tokenizer(corpus: Sequence[str], vocab_size: int) -> Any:
    """A Qwen2-style byte-level BPE tokenizer trained on ``corpus`` (a transformers fast
    tokenizer with this module's EOS and pad tokens and `CHAT_TEMPLATE`); deterministic."""
    from transformers import PreTrainedTokenizerFast

    raw = _train_tokenizer(corpus, vocab_size)
    fast_cls: Any = PreTrainedTokenizerFast
    tokenizer = fast_cls(
        tokenizer_object=raw, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=EOS_TOKEN
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _quiet(stage: str, figures: dict[str, Any]) -> None:
    """A `BuildProgress` that says nothing."""


def _write(dest: Path, spec: TinySpec, corpus: Sequence[str],
           progress: BuildProgress = _quiet) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    hf_logging: Any = importlib.import_module("transformers.utils.logging")
    hf_logging.disable_progress_bar()  # build logs stay line-oriented
    # An end-of-text token inside a line (a turn's end) is no text to learn merges from.
    tokenizer = build_tokenizer([line.replace(EOS_TOKEN, "\n") for line in corpus],
                                spec.vocab_size)
    progress("tokenizer", {"tokens": tokenizer.backend_tokenizer.get_vocab_size()})
    lm = spec.head == "lm"
    # The score head: one output and no vocabulary head to tie (a causal LM's config is as it
    # always was, so its files stay byte-identical).
    head: dict[str, Any] = {"tie_word_embeddings": True} if lm else {
        "tie_word_embeddings": False, "num_labels": 1}
    config = Qwen2Config(
        vocab_size=tokenizer.backend_tokenizer.get_vocab_size(),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **head,
    )
    # One intra-op thread, the caller's count restored after. A second gains a tiny model
    # little (the default build: 33 s against 41 on 2 quiet cores) and, with anything else on
    # the cores, its threads wait on each other: 5-7 times slower beside one busy process or
    # another build. The built bytes are the same either way.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # A private RNG stream: the build is reproducible and leaves the caller's RNG untouched.
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            model_cls: Any = Qwen2ForCausalLM if lm else Qwen2ForSequenceClassification
            model: Any = model_cls(config)
            progress("model", {"parameters": sum(p.numel() for p in model.parameters())})
            if spec.pretrain_steps:
                _pretrain(model, tokenizer, corpus, spec.pretrain_steps, spec.seed, progress,
                          spec.pretrain_until)
    finally:
        torch.set_num_threads(threads)
    progress("save", {})
    model.eval()
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    # The manifest goes last: it marks the directory complete.
    (dest / MANIFEST).write_text(json.dumps(spec.manifest(), indent=2, sort_keys=True) + "\n")


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def tiny_spec(
    *,
    vocab_size: int = 1024,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 512,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    pretrain_steps: int = 0,
    corpus_kind: CorpusKind = "mixed",
    head: HeadKind = "lm",
    pretrain_until: float | None = None,
) -> tuple[TinySpec, list[str]]:
    """The spec `build_tiny_model` builds with these settings, and its corpus; ValueError for
    settings it cannot build."""
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must divide by heads and heads by kv_heads")
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; have {list(HEADS)}")
    if head == "score" and pretrain_steps:
        raise ValueError("a tiny reward model (head='score') has no language-modelling warm-up; "
                         "pretrain_steps must be 0")
    lines = list(corpus) if corpus is not None else synthetic_corpus(seed, kind=corpus_kind)
    if not lines:
        raise ValueError("corpus is empty")
    if not pretrain_steps:
        pretrain_until = None  # no warm-up: nothing to end early, the same build as without
    if pretrain_until is not None:
        if not 0.0 < pretrain_until <= 1.0:
            raise ValueError(f"pretrain_until is a share in (0, 1], got {pretrain_until}")
        if not answer_pairs(lines):
            raise ValueError("pretrain_until needs a corpus with 'question=answer' lines")
    spec = TinySpec(
        vocab_size=vocab_size,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate if intermediate is not None else 4 * hidden,
        max_positions=max_positions,
        seed=seed,
        corpus_sha256=_corpus_digest(lines),
        pretrain_steps=pretrain_steps,
        libraries=build_versions(),
        head=head,
        pretrain_until=pretrain_until,
    )
    return spec, lines


def is_built(out_dir: str | os.PathLike[str], **settings: Any) -> bool:
    """Whether ``out_dir`` holds what `build_tiny_model` with ``settings`` (its keyword
    arguments) builds, so that it would be reused as is."""
    spec, _ = tiny_spec(**settings)
    return _read_manifest(Path(out_dir)) == spec.manifest()


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    vocab_size: int = 1024,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 512,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    pretrain_steps: int = 0,
    corpus_kind: CorpusKind = "mixed",
    head: HeadKind = "lm",
    pretrain_until: float | None = None,
    progress: BuildProgress | None = None,
) -> Path:
    """Build (or reuse) a tiny Qwen2 model and tokenizer in ``out_dir``; return its path.

    ``corpus`` defaults to `synthetic_corpus(seed, kind=corpus_kind)`. ``pretrain_steps`` > 0
    runs that many language-modelling steps (batch 32) on the corpus before saving; 0 keeps
    random weights. ``pretrain_until`` (a share) ends the warm-up earlier, once the model
    answers that share of the corpus's distinct ``question=answer`` lines exactly (greedily;
    `known_share`, checked every `KNOWN_EVERY` steps): how fast a model learns its facts
    depends on the CPU's kernels, so a fixed number of steps leaves models built on different
    CPUs knowing different amounts, and a target leaves them knowing about the same.
    The tokenizer's vocabulary is at most ``vocab_size`` (fewer if the corpus has too few
    merges); the model's vocabulary equals the tokenizer's.
    ``head="score"`` builds a reward model (one scalar per sequence) with random weights
    instead of a causal LM; it has no language-modelling warm-up.
    ``progress`` is told what the build does (`BuildProgress`); a model that is reused says
    nothing. An exception (KeyboardInterrupt included) leaves no directory that looks built.
    """
    spec, lines = tiny_spec(
        vocab_size=vocab_size, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        intermediate=intermediate, max_positions=max_positions, seed=seed, corpus=corpus,
        pretrain_steps=pretrain_steps, corpus_kind=corpus_kind, head=head,
        pretrain_until=pretrain_until)
    out = Path(out_dir)
    if _read_manifest(out) == spec.manifest():
        return out
    told = progress or _quiet
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            _write(tmp, spec, lines, told)
            try:
                tmp.rename(out)
                return out
            except OSError:
                # Someone else created out_dir meanwhile; theirs wins if it is what we want.
                if _read_manifest(out) == spec.manifest():
                    return out
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    # An existing directory with another spec (or none): rebuild in place, manifest last.
    (out / MANIFEST).unlink(missing_ok=True)
    _write(out, spec, lines, told)
    return out


def _interrupt_once(signum: int, frame: object) -> None:
    """SIGINT or SIGTERM: stop the build (its temporary directory is removed on the way out);
    a second signal must not cut that short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _say(json_lines: bool) -> BuildProgress:
    """Progress on stderr: JSON lines (``{"stage": ..., **figures}``) for the launcher, which
    reads them, else one plain line per stage and every 10th warm-up step."""

    def say(stage: str, figures: dict[str, Any]) -> None:
        if json_lines:
            print(json.dumps({"stage": stage, **figures}), file=sys.stderr, flush=True)
        elif stage != "warmup" or figures["step"] % 10 == 0:
            shown = " ".join(f"{k}={v}" for k, v in figures.items())
            print(f"{stage} {shown}".rstrip(), file=sys.stderr, flush=True)

    return say


def main(argv: Sequence[str] | None = None) -> int:
    from flowrl.lifecycle import die_with_parent

    die_with_parent()  # when the launcher builds the model in this process (`flowrl.run`)
    signal.signal(signal.SIGINT, _interrupt_once)
    signal.signal(signal.SIGTERM, _interrupt_once)
    parser = argparse.ArgumentParser(prog="python -m flowrl.tiny_model", description=__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--max-positions", type=int, default=512)
    parser.add_argument("--pretrain-steps", type=int, default=0)
    parser.add_argument("--pretrain-until", type=float, default=None,
                        help="end the warm-up once this share of the corpus's questions is "
                             "answered exactly (checked every 100 steps)")
    parser.add_argument("--corpus", choices=CORPORA, default="mixed")
    parser.add_argument("--head", choices=HEADS, default="lm")
    parser.add_argument("--json-progress", action="store_true",
                        help="say the build's progress as JSON lines on stderr")
    args = parser.parse_args(argv)
    try:
        path = build_tiny_model(
            args.out_dir,
            seed=args.seed,
            vocab_size=args.vocab_size,
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            max_positions=args.max_positions,
            pretrain_steps=args.pretrain_steps,
            pretrain_until=args.pretrain_until,
            corpus_kind=args.corpus,
            head=args.head,
            progress=_say(args.json_progress),
        )
    except KeyboardInterrupt:
        print("interrupted: nothing was built", file=sys.stderr, flush=True)
        return 130
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
