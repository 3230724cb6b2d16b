"""RULER-style synthetic long-context tasks over real text, and a long-range copy task.

Every sample is a pure function of (task, tokenizer, context length, seed). Retrieval tasks hide
facts in a haystack of held-out real text (the Python docs' evaluation split); the word tasks
build their own word lists from the corpus's vocabulary, as RULER does. Each sample carries:

  prompt_ids   the chat prompt, ending with an answer prefix the model continues (RULER style)
  answers      the strings to find in the generated text (exact match = the share found)
  target_ids   the tokens of the reference continuation, for teacher-forced log-likelihood

The copy task has no question: a passage of real text, thousands of tokens of other text, the
same passage again; it is scored by teacher forcing alone (token accuracy and NLL on the
repeat), which measures whether attention finds the first copy.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from sparda_jax.text import corpus_split, haystack_tokens, insert_at_depth, python_docs_corpus

__all__ = ["TASKS", "Sample", "make_sample", "word_pool"]

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "copy")


@dataclass
class Sample:
    task: str
    prompt_ids: list[int]
    answers: list[str]
    target_ids: list[int]
    # copy task: the positions (in prompt_ids) of the repeated passage, scored by teacher forcing
    repeat: tuple[int, int] | None = None
    meta: dict = field(default_factory=dict)

    def exact_match(self, generated: str) -> float:
        if not self.answers:
            return float("nan")
        g = generated.lower()
        return sum(a.lower() in g for a in self.answers) / len(self.answers)


@lru_cache(maxsize=1)
def word_pool() -> tuple[str, ...]:
    """Lower-case words of 4-9 letters that occur at least 3 times in the corpus, sorted."""
    counts = Counter(w for d in python_docs_corpus() for w in re.findall(r"\b[a-z]{4,9}\b", d))
    return tuple(sorted(w for w, c in counts.items() if c >= 3))


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _key(rng: random.Random) -> str:
    a, b = rng.sample(word_pool(), 2)
    return f"{a}-{b}"


def _chat(tok, body: list[int], question: str, prefix: str) -> list[int]:
    head, tail = tok.chat_prompt("\x00").split("\x00")
    return (tok.encode(head + "Read the text below and answer the question after it.\n\n") + body
            + tok.encode(f"\n\n{question}{tail}{prefix}"))


def _fit(tok, context_tokens: int, build) -> list[int]:
    """build(n) -> prompt ids, growing with n; find the n that lands within 8 tokens of
    context_tokens (secant steps on the measured lengths)."""
    n0, ids0 = context_tokens, build(context_tokens)
    n1 = max(16, n0 + context_tokens - len(ids0))
    for _ in range(12):
        if abs(len(ids0) - context_tokens) <= 8:
            return ids0
        ids1 = build(n1)
        slope = (len(ids1) - len(ids0)) / (n1 - n0) if n1 != n0 else 1.0
        n0, ids0 = n1, ids1
        n1 = max(16, round(n1 + (context_tokens - len(ids1)) / (slope if slope > 0.05 else 1.0)))
    return ids0


def _needles(tok, hay: list[int], sentences: list[str], rng: random.Random) -> list[int]:
    depths = sorted(rng.uniform(0.05, 0.95) for _ in sentences)
    for s, d in sorted(zip(sentences, depths), key=lambda x: -x[1]):  # deepest first keeps depths
        hay = insert_at_depth(hay, tok.encode("\n" + s + "\n"), d, tok.decode)
    return hay


def make_sample(task: str, tok, context_tokens: int, seed: int) -> Sample:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    rng = random.Random(f"{task}-{context_tokens}-{seed}")
    eval_docs = corpus_split(python_docs_corpus(), "eval")
    hay = lambda n: haystack_tokens(tok.encode, n, seed=rng.randint(0, 10**6), docs=eval_docs)

    if task.startswith("niah"):
        n_keys = {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": 1, "niah_multiquery": 4}[task]
        n_vals = 4 if task == "niah_multivalue" else 1
        keys = [_key(rng) for _ in range(n_keys)]
        vals = {k: [_number(rng) for _ in range(n_vals)] for k in keys}
        sentences = [f"One of the special magic numbers for {k} is: {v}." for k in keys for v in vals[k]]
        asked = keys if task == "niah_multiquery" else keys[:1]
        answers = [v for k in asked for v in vals[k]]
        if task == "niah_multiquery":
            question = f"What are the special magic numbers for {', '.join(asked)}?"
            prefix = f"The special magic numbers for {', '.join(asked)} are:"
        elif task == "niah_multivalue":
            question = f"What are all the special magic numbers for {asked[0]} mentioned in the text?"
            prefix = f"The special magic numbers for {asked[0]} are:"
        else:
            question = f"What is the special magic number for {asked[0]} mentioned in the text?"
            prefix = f"The special magic number for {asked[0]} mentioned in the text is:"
        state = rng.getstate()

        def build(n):
            rng.setstate(state)
            return _chat(tok, _needles(tok, hay(n), sentences, rng), question, prefix)

        ids = _fit(tok, context_tokens, build)
        return Sample(task, ids, answers, tok.encode(" " + ", ".join(answers) + "."), meta={"keys": keys})

    if task == "vt":
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(5)]
        value = str(rng.randint(10000, 99999))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
        question = f"Find all variables that are assigned the value {value} in the text above."
        prefix = (f"Answer: According to the chain of variable assignments in the text above, "
                  f"5 variables are assigned the value {value}, they are:")
        state = rng.getstate()

        def build(n):
            rng.setstate(state)
            h = hay(n)
            depths = sorted(rng.uniform(0.05, 0.95) for _ in chain)
            for s, d in sorted(zip(chain, depths), key=lambda x: -x[1]):
                h = insert_at_depth(h, tok.encode("\n" + s + "\n"), d, tok.decode)
            return _chat(tok, h, question, prefix)

        ids = _fit(tok, context_tokens, build)
        return Sample(task, ids, names, tok.encode(" " + " ".join(names) + "."))

    if task == "cwe":
        pool = list(word_pool())
        common = rng.sample(pool, 10)
        rare = [w for w in rng.sample(pool, 400) if w not in common]
        question = "What are the 10 most common words in the above list?"
        prefix = "Answer: The top 10 words that appear most often in the list are:"

        def build(n):
            r = random.Random(seed)
            # ~n tokens of list: each common word 30 times as often as a rare one
            per_word = 4  # tokens per "k. word " entry, roughly
            total = max(40, n // per_word)
            n_common = min(total // 2, 30 * 10)
            words = [common[i % 10] for i in range(n_common)]
            words += [rare[i % len(rare)] for i in range(total - n_common)]
            r.shuffle(words)
            text = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
            return _chat(tok, tok.encode(text), question, prefix)

        ids = _fit(tok, context_tokens, build)
        return Sample(task, ids, common, tok.encode(" " + ", ".join(common) + "."))

    if task == "fwe":
        pool = list(word_pool())
        vocab = rng.sample(pool, 200)
        question = "What are the 3 most frequently appeared words in the above coded text?"
        prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
        # Zipf weights (alpha 2): the top three are clearly the most frequent
        weights = [1.0 / (i + 1) ** 2 for i in range(len(vocab))]

        def build(n):
            r = random.Random(seed)
            words = r.choices(vocab, weights=weights, k=max(30, n // 2))
            return _chat(tok, tok.encode(" ".join(words)), question, prefix)

        ids = _fit(tok, context_tokens, build)
        return Sample(task, ids, vocab[:3], tok.encode(" " + ", ".join(vocab[:3]) + "."))

    # copy: passage, other text, passage again (raw text, no chat template). The passage and
    # the filler come from disjoint halves of the held-out documents, so the only earlier
    # occurrence of the passage is its first copy.
    passage = haystack_tokens(tok.encode, 256, seed=rng.randint(0, 10**6), docs=eval_docs[0::2])
    filler_n = context_tokens - 2 * len(passage)
    if filler_n < 64:
        raise ValueError(f"context_tokens={context_tokens} leaves no room between the two copies")
    filler = haystack_tokens(tok.encode, filler_n, seed=rng.randint(0, 10**6), docs=eval_docs[1::2])
    ids = passage + filler + passage
    start = len(passage) + len(filler)
    return Sample(task, ids, [], [], repeat=(start, len(ids)), meta={"passage_tokens": len(passage)})
