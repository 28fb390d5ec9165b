#!/usr/bin/env python3
"""The official `openai` SDK against `troupe serve` (the embedded tiny model).

Oracles: `troupe forward` (greedy tokens are its argmax continuation), the
Hugging Face `tokenizers` library (prompt ids), the non-streaming answer (for
the streaming one), a model whose config names another EOS id (for ignore_eos
and min_tokens).
"""
import datetime
import json
import os
import re
import shutil
import tempfile
from types import SimpleNamespace
from typing import Literal, Optional

import jsonschema
import openai
import pydantic
from tokenizers import Tokenizer

import harness

A = harness.args()
MODEL = "deepseek-v4-tiny"
server = None


def srv():
    global server
    if server is None or not server.alive():
        server = harness.Server(A.troupe, A.home, name="sdk")
    return server


def client(s=None):
    return openai.OpenAI(api_key="unused", base_url=(s or srv()).base_url, max_retries=0, timeout=120)


def extra(choice, key):
    return (choice.model_extra or {}).get(key)


PROMPT = "The actors of a serving runtime pass messages"


def greedy(prompt=PROMPT, n=12, **kw):
    r = client().completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                    extra_body=dict(return_token_ids=True, **kw))
    return r


def test_completion_greedy_is_forward_argmax():
    r = greedy()
    c = r.choices[0]
    ids, prompt_ids = extra(c, "token_ids"), extra(c, "prompt_token_ids")
    assert len(ids) == 12 and c.finish_reason == "length", (ids, c.finish_reason)
    tok = Tokenizer.from_file(os.path.join(harness.model_dir(A.home), "tokenizer.json"))
    assert prompt_ids == [0] + tok.encode(PROMPT, add_special_tokens=False).ids, prompt_ids
    bad = harness.check_greedy(A.troupe, harness.model_dir(A.home), prompt_ids, ids)
    assert not bad, f"tokens differ from troupe forward's argmax at {bad}: {ids}"
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == len(prompt_ids) + 12
    assert c.text == tok.decode(ids, skip_special_tokens=False), (c.text, tok.decode(ids))
    # The same prompt as token ids gives the same tokens.
    r2 = client().completions.create(model=MODEL, prompt=prompt_ids, max_tokens=12, temperature=0,
                                     extra_body=dict(return_token_ids=True))
    assert extra(r2.choices[0], "token_ids") == ids


def test_completion_stream_equals_non_stream():
    ref = greedy(n=10).choices[0]
    stream = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body=dict(return_token_ids=True))
    ids, text, finish, usage, chunks = [], "", None, None, 0
    for ch in stream:
        chunks += 1
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            text += c.text
            ids += extra(c, "token_ids") or []
            finish = c.finish_reason or finish
    assert ids == extra(ref, "token_ids"), (ids, extra(ref, "token_ids"))
    assert text == ref.text and finish == "length" and chunks >= 10
    assert usage is not None and usage.completion_tokens == 10


def test_chat_greedy_is_forward_argmax_and_stream_matches():
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three actors."}]
    r = client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                         extra_body=dict(return_token_ids=True))
    c = r.choices[0]
    assert c.message.role == "assistant" and r.object == "chat.completion"
    ids, prompt_ids = extra(c, "token_ids"), extra(c, "prompt_token_ids")
    assert len(ids) == 8, ids
    bad = harness.check_greedy(A.troupe, harness.model_dir(A.home), prompt_ids, ids)
    assert not bad, f"chat tokens differ from troupe forward's argmax at {bad}"
    assert r.usage.prompt_tokens == len(prompt_ids)
    stream = client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                              extra_body=dict(return_token_ids=True))
    sids, text, roles = [], "", set()
    for ch in stream:
        assert ch.object == "chat.completion.chunk"
        for d in ch.choices:
            text += d.delta.content or ""
            if d.delta.role:
                roles.add(d.delta.role)
            sids += extra(d, "token_ids") or []
    assert sids == ids and text == c.message.content and roles == {"assistant"}


def test_logprobs_are_the_forward_logits_log_softmax():
    """Completions "logprobs": N and chat "logprobs"/"top_logprobs": each token's
    logprob is the log-softmax of `troupe forward`'s logits at its position; the
    greedy token is the first alternative; streaming gives the same entries."""
    import numpy as np
    r = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body=dict(return_token_ids=True))
    c = r.choices[0]
    ids, prompt_ids, lp = extra(c, "token_ids"), extra(c, "prompt_token_ids"), c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) == 6, lp
    logits = harness.forward_logits(A.troupe, harness.model_dir(A.home), list(prompt_ids) + ids[:-1], len(prompt_ids))
    rows = logits[len(prompt_ids) - 1:].astype(np.float64)
    ref = rows - (rows.max(axis=1, keepdims=True) + np.log(np.exp(rows - rows.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)))
    for i, t in enumerate(ids):
        assert abs(lp.token_logprobs[i] - ref[i, t]) < 1e-3, (i, lp.token_logprobs[i], ref[i, t])
        assert len(lp.top_logprobs[i]) == 3, lp.top_logprobs[i]
        assert max(lp.top_logprobs[i].values()) == lp.token_logprobs[i]  # greedy: the best one
        assert lp.text_offset[i] == sum(len(x.encode()) for x in lp.tokens[:i]) or i == 0
    # Chat, streamed against not streamed.
    msgs = [{"role": "user", "content": "Name three actors."}]
    r = client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content), content
    assert all(e.top_logprobs[0].logprob == e.logprob for e in content)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == r.choices[0].message.content
    streamed = []
    for ch in client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                               top_logprobs=2, stream=True):
        for d in ch.choices:
            if d.logprobs and d.logprobs.content:
                streamed += d.logprobs.content
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]
    # Bad values are a 400 naming the parameter.
    for kw in (dict(logprobs=21, max_tokens=2), dict(logprobs=2, max_tokens=0)):
        try:
            client().completions.create(model=MODEL, prompt=PROMPT, **kw)
            raise AssertionError(f"{kw} was accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and ("logprobs" in str(e) or "max_tokens" in str(e)), e
    try:
        client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, top_logprobs=2)
        raise AssertionError("top_logprobs without logprobs was accepted")
    except openai.BadRequestError as e:
        assert "top_logprobs" in str(e), e


def log_softmax(rows):
    import numpy as np
    rows = rows.astype(np.float64)
    m = rows.max(axis=1, keepdims=True)
    return rows - (m + np.log(np.exp(rows - m).sum(axis=1, keepdims=True)))


def test_echo_with_logprobs_scores_the_prompt():
    """Completions' "echo" with "logprobs" (what lm-evaluation-harness's loglikelihood
    asks): the prompt's tokens come first, the first with null, each other with the
    log-softmax of `troupe forward`'s row before it, then the answer's entries as
    without echo; "max_tokens": 0 gives the prompt alone; streaming gives the same
    entries (the echo first); a batch of token-id prompts is scored prompt by prompt."""
    n = 3
    plain = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=n, temperature=0, logprobs=2,
                                        extra_body=dict(return_token_ids=True)).choices[0]
    r = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=n, temperature=0, logprobs=2, echo=True,
                                    extra_body=dict(return_token_ids=True))
    c = r.choices[0]
    prompt_ids, ids, lp = extra(c, "prompt_token_ids"), extra(c, "token_ids"), c.logprobs
    P = len(prompt_ids)
    assert ids == extra(plain, "token_ids") and c.text == PROMPT + plain.text, (c.text, plain.text)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == P + n, lp
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = log_softmax(harness.forward_logits(A.troupe, harness.model_dir(A.home), prompt_ids, P))
    for i in range(1, P):
        assert abs(lp.token_logprobs[i] - ref[i - 1, prompt_ids[i]]) < 1e-3, (i, lp.token_logprobs[i], ref[i - 1, prompt_ids[i]])
        top = lp.top_logprobs[i]
        assert len(top) == 2 and abs(max(top.values()) - ref[i - 1].max()) < 1e-3, (i, top)
    assert lp.token_logprobs[P:] == plain.logprobs.token_logprobs and lp.tokens[P:] == plain.logprobs.tokens
    assert lp.text_offset == [sum(len(t.encode()) for t in lp.tokens[:i]) for i in range(P + n)], lp.text_offset
    assert r.usage.prompt_tokens == P and r.usage.completion_tokens == n
    # The prompt alone.
    z = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=2, echo=True)
    zc = z.choices[0]
    assert zc.text == PROMPT and zc.finish_reason == "length" and z.usage.completion_tokens == 0, zc
    assert zc.logprobs.token_logprobs == lp.token_logprobs[:P] and zc.logprobs.tokens == lp.tokens[:P]
    # Streamed: the echo (with the prompt's entries) first, then the answer's.
    text, entries, first = "", [], None
    for ch in client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=n, temperature=0, logprobs=2,
                                          echo=True, stream=True):
        for d in ch.choices:
            first = d.text if first is None else first
            text += d.text
            if d.logprobs:
                entries += list(zip(d.logprobs.tokens, d.logprobs.token_logprobs, d.logprobs.text_offset))
    assert first == PROMPT and text == c.text, (first, text)
    assert entries == list(zip(lp.tokens, lp.token_logprobs, lp.text_offset)), entries
    # A batch of token-id prompts, as lm-evaluation-harness sends a context and its continuation.
    other = prompt_ids[:4] + [77, 78, 79]
    b = client().completions.create(model=MODEL, prompt=[prompt_ids, other], max_tokens=0, logprobs=1, echo=True)
    assert [x.index for x in b.choices] == [0, 1]
    assert b.choices[0].logprobs.token_logprobs == lp.token_logprobs[:P]
    ref2 = log_softmax(harness.forward_logits(A.troupe, harness.model_dir(A.home), other, len(other)))
    got = b.choices[1].logprobs.token_logprobs
    assert got[0] is None and all(abs(got[i] - ref2[i - 1, other[i]]) < 1e-3 for i in range(1, len(other))), got
    assert b.usage.prompt_tokens == P + len(other) and b.usage.completion_tokens == 0


def penalized_mismatches(prompt_ids, ids, rp, fp, pp):
    """Checks `ids` against `troupe forward`'s logits after the penalties over the sequence so
    far (repetition on prompt and answer, frequency and presence on the answer), in float32 as
    the server computes them. Returns (positions where the penalized argmax differs, positions
    where the penalties changed the raw argmax)."""
    import numpy as np
    rp, fp, pp = np.float32(rp), np.float32(fp), np.float32(pp)
    logits = harness.forward_logits(A.troupe, harness.model_dir(A.home), list(prompt_ids) + ids[:-1], len(prompt_ids))
    rows = logits[len(prompt_ids) - 1:].astype(np.float32)
    seq, bad, changed = list(prompt_ids), [], []
    for i, t in enumerate(ids):
        row = rows[i].copy()
        if int(np.argmax(row)) != t:
            changed.append(i)
        for tok in set(seq):
            row[tok] = row[tok] / rp if row[tok] > 0 else row[tok] * rp
        answer = seq[len(prompt_ids):]
        for tok in set(answer):
            row[tok] -= fp * np.float32(answer.count(tok)) + pp
        best = int(np.argmax(row))
        if best != t and abs(row[best] - row[t]) >= 1e-5:
            bad.append((i, t, best))
        seq.append(t)
    return bad, changed


def test_penalties_pick_the_argmax_of_the_penalized_forward_logits():
    """frequency_penalty / presence_penalty (OpenAI) and repetition_penalty (vLLM's
    extension): each greedy token is the argmax of `troupe forward`'s logits after
    the penalties over the sequence so far; streaming and chat take them too; bad
    values are a 400 naming the parameter. The values pull towards repeats: with
    random weights nothing repeats by itself, so only then do they change tokens."""
    rp, fp, pp, n = 0.8, 0.3, -2.0, 24
    kw = dict(model=MODEL, max_tokens=n, temperature=0, frequency_penalty=fp, presence_penalty=pp)
    r = client().completions.create(prompt=PROMPT, extra_body=dict(return_token_ids=True, repetition_penalty=rp), **kw)
    c = r.choices[0]
    ids, prompt_ids = extra(c, "token_ids"), extra(c, "prompt_token_ids")
    assert len(ids) == n, ids
    bad, changed = penalized_mismatches(prompt_ids, ids, rp, fp, pp)
    assert not bad, f"not the penalized argmax at {bad}: {ids}"
    assert changed, "the penalties changed no token: this shows nothing"
    streamed = []
    for ch in client().completions.create(prompt=PROMPT, stream=True, extra_body=dict(
            return_token_ids=True, repetition_penalty=rp), **kw):
        streamed += extra(ch.choices[0], "token_ids") or []
    assert streamed == ids, (streamed, ids)
    msgs = [{"role": "user", "content": "Name three actors."}]
    chat = client().chat.completions.create(messages=msgs, extra_body=dict(return_token_ids=True,
                                                                           repetition_penalty=rp), **kw)
    chat_ids = extra(chat.choices[0], "token_ids")
    assert len(chat_ids) == n, chat
    bad, _ = penalized_mismatches(extra(chat.choices[0], "prompt_token_ids"), chat_ids, rp, fp, pp)
    assert not bad, f"chat: not the penalized argmax at {bad}: {chat_ids}"
    for body, param in ((dict(frequency_penalty=2.5), "frequency_penalty"),
                        (dict(presence_penalty=-3), "presence_penalty"),
                        (dict(extra_body=dict(repetition_penalty=0)), "repetition_penalty"),
                        (dict(extra_body=dict(repetition_penalty="high")), "repetition_penalty")):
        try:
            client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **body)
            raise AssertionError(f"{body} was accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and param in str(e), e


def test_logit_bias_forces_and_bans_tokens():
    """OpenAI's logit_bias ({"token id": bias in [-100, 100]}): +100 on one token makes
    greedy pick it every time; -100 on the greedy answer's first token makes the
    answer start with `troupe forward`'s second best; bad maps are a 400."""
    import numpy as np
    forced = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                         logit_bias={"1000": 100}, extra_body=dict(return_token_ids=True))
    assert extra(forced.choices[0], "token_ids") == [1000] * 6, forced
    plain = greedy(n=4).choices[0]
    ids, prompt_ids = extra(plain, "token_ids"), extra(plain, "prompt_token_ids")
    banned = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                         logit_bias={str(ids[0]): -100}, extra_body=dict(return_token_ids=True))
    first = extra(banned.choices[0], "token_ids")[0]
    row = harness.forward_logits(A.troupe, harness.model_dir(A.home), list(prompt_ids), len(prompt_ids))[-1]
    assert first == int(np.argsort(-row, kind="stable")[1]), (first, ids)
    # Chat and streaming take it too.
    msgs = [{"role": "user", "content": "Name three actors."}]
    streamed = []
    for ch in client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0, stream=True,
                                               logit_bias={"2000": 100}, extra_body=dict(return_token_ids=True)):
        streamed += extra(ch.choices[0], "token_ids") or []
    assert streamed == [2000] * 3, streamed
    for lb in ({"abc": 1}, {"5": 101}, {"5": "x"}, {"-3": 1}, {"99999999": 5}, [1, 2]):
        try:
            client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias=lb)
            raise AssertionError(f"{lb} was accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and "logit_bias" in str(e), e


def test_priority_orders_the_waiting_requests():
    """`priority` (larger first, as SGLang by default): on a server that runs one
    request at a time, requests that wait behind a long one start by priority,
    not by arrival."""
    import threading
    import time
    s = harness.Server(A.troupe, A.home, extra=["--max-running", "1"], name="priority")
    try:
        c = client(s)
        done, lock = [], threading.Lock()

        def run(tag, prio, n):
            c.completions.create(model=MODEL, prompt=f"{tag} {PROMPT}", max_tokens=n, temperature=0,
                                 extra_body=dict(priority=prio, ignore_eos=True))
            with lock:
                done.append(tag)

        started = threading.Event()

        def run_long():  # streamed: its first token says it runs (a fixed sleep did not, on a loaded machine)
            stream = c.completions.create(model=MODEL, prompt=f"long {PROMPT}", max_tokens=600, temperature=0,
                                          stream=True, extra_body=dict(priority=0, ignore_eos=True))
            for _ in stream:
                started.set()
            with lock:
                done.append("long")

        long = threading.Thread(target=run_long)  # seconds: the others queue meanwhile
        long.start()
        assert started.wait(60), "the long request never started"
        waiting = [threading.Thread(target=run, args=(tag, prio, 2)) for tag, prio in
                   (("low", -5, ), ("mid", 0), ("high", 9))]
        for t in waiting:
            t.start()
            time.sleep(0.1)
        for t in [long] + waiting:
            t.join(timeout=120)
        assert done == ["long", "high", "mid", "low"], done
        try:
            c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=dict(priority="urgent"))
            raise AssertionError("a string priority was accepted")
        except openai.BadRequestError as e:
            assert "priority" in str(e), e
    finally:
        s.stop()


def test_repeated_prompt_reports_cached_tokens():
    long_prompt = " ".join(f"word{i}" for i in range(120))
    first = greedy(long_prompt, n=4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0, first.usage
    second = greedy(long_prompt, n=4)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Pages of 32 tokens; the match resumes at the last checkpoint before the end.
    assert cached >= first.usage.prompt_tokens - 64 and cached < first.usage.prompt_tokens, (cached, second.usage)
    assert extra(second.choices[0], "token_ids") == extra(first.choices[0], "token_ids")


def test_stop_strings_cut_the_text():
    ref = greedy(n=16).choices[0]
    text = ref.text
    # A stop string from the middle of the greedy text: the answer ends right before its first occurrence.
    k = len(text) // 2
    stop = text[k:k + 3]
    cut = text[:text.index(stop)]
    r = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop", (r.choices[0], stop, text)
    streamed = "".join(c.text for ch in client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True) for c in ch.choices)
    assert streamed == cut, (streamed, cut)


def test_seed_reproducible_sampling():
    def sample(seed, stream=False):
        kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.95, seed=seed,
                  extra_body=dict(return_token_ids=True))
        if not stream:
            return extra(client().completions.create(**kw).choices[0], "token_ids")
        return [t for ch in client().completions.create(stream=True, **kw) for c in ch.choices
                for t in (extra(c, "token_ids") or [])]
    a, b, c = sample(1234), sample(1234), sample(1235)
    assert a == b, (a, b)
    assert a != c, "a different seed gave the same 12 sampled tokens"
    assert sample(1234, stream=True) == a
    assert a != extra(greedy().choices[0], "token_ids")


def test_min_p_cuts_sampling_to_the_likeliest_tokens():
    """min_p (vLLM/SGLang): at 1 only the likeliest token is left, so sampling at any
    temperature and seed is greedy; a small min_p leaves the seeds their say; out of
    range is a 400 naming it."""
    def sample(min_p, seed):
        kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.5, seed=seed,
                  extra_body=dict(return_token_ids=True, min_p=min_p))
        return extra(client().completions.create(**kw).choices[0], "token_ids")
    want = extra(greedy().choices[0], "token_ids")
    assert sample(1.0, 5) == want and sample(1.0, 6) == want, (sample(1.0, 5), want)
    assert sample(1e-9, 5) != sample(1e-9, 6), "two seeds sampled the same 12 tokens"
    try:
        client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=dict(min_p=2))
        raise AssertionError("min_p 2 was accepted")
    except openai.BadRequestError as e:
        assert "min_p" in str(e), e


def test_n_choices_and_batched_prompts():
    """n > 1 and completions batches: one request per choice, answered as one response in the
    API's order (prompt-major). With a seed, choice i samples as a lone request with seed + i."""
    kw = dict(model=MODEL, max_tokens=8, temperature=1.0, extra_body=dict(return_token_ids=True))
    r = client().completions.create(prompt=PROMPT, n=3, seed=77, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2], r.choices
    for i, c in enumerate(r.choices):
        alone = client().completions.create(prompt=PROMPT, seed=77 + i, **kw).choices[0]
        assert extra(c, "token_ids") == extra(alone, "token_ids") and c.text == alone.text, (i, c, alone)
    prompt_ids = extra(r.choices[0], "prompt_token_ids")
    assert r.usage.prompt_tokens == len(prompt_ids), r.usage  # counted once for the three choices
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == len(prompt_ids) + 24, r.usage
    # a batch of two prompts, two greedy choices each: choices 0-1 the first prompt's argmax, 2-3 the second's
    other = "A second prompt, about pages"
    b = client().completions.create(model=MODEL, prompt=[PROMPT, other], n=2, max_tokens=6, temperature=0,
                                    extra_body=dict(return_token_ids=True))
    want = [extra(greedy(p, n=6).choices[0], "token_ids") for p in (PROMPT, other)]
    assert [extra(c, "token_ids") for c in b.choices] == [want[0], want[0], want[1], want[1]], b.choices
    lens = [len(extra(b.choices[0], "prompt_token_ids")), len(extra(b.choices[2], "prompt_token_ids"))]
    assert b.usage.prompt_tokens == sum(lens) and b.usage.completion_tokens == 24, b.usage
    # token-id batches too
    ids_batch = client().completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0)
    assert [c.index for c in ids_batch.choices] == [0, 1]
    # the stream of a chat with n = 3: each index's text equals the whole answer's choice with that index
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Three takes, please."}], max_tokens=6,
                temperature=1.0, seed=5, n=3)
    whole = client().chat.completions.create(**chat)
    texts, finish, usage, done = {}, {}, None, 0
    for ch in client().chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat):
        if ch.usage:
            usage = ch.usage
            done += 1
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert texts == {c.index: c.message.content for c in whole.choices}, (texts, whole.choices)
    assert finish == {0: "length", 1: "length", 2: "length"}, finish
    assert done == 1 and usage.completion_tokens == 18 and usage.prompt_tokens == whole.usage.prompt_tokens, usage
    # too many choices: a 400 naming the parameter
    try:
        client().completions.create(model=MODEL, prompt=[PROMPT] * 5, n=30, max_tokens=1)
        raise AssertionError("150 choices were accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "prompt" and "at most 128 choices" in e.body["message"], e.body


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string", "maxLength": 12}},
                                                          "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_tool_calls():
    """Chat "tools": their definitions go into the prompt (with the template's own
    tool markers); tool_choice naming a function (or "required") starts the answer
    inside a call, so the answer comes back as tool_calls whose arguments are the
    generated text, held to the function's parameters (JSON valid under them, the
    call ending with the value), streamed alike;
    tool_choice "none" leaves the prompt as without tools; a conversation with
    earlier calls and their results renders; bad tool fields are a 400."""
    tok = Tokenizer.from_file(os.path.join(harness.model_dir(A.home), "tokenizer.json"))
    marker = {m: tok.token_to_id(m) for m in ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                              "<｜tool▁outputs▁begin｜>", "<｜Assistant｜>")}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    s = srv()
    status, plain = s.post("/tokenize", {"model": MODEL, "messages": msgs})
    status, with_tools = s.post("/tokenize", {"model": MODEL, "messages": msgs, "tools": [WEATHER, CLOCK]})
    assert status == 200, with_tools
    ids = with_tools["tokens"]
    text = tok.decode(ids, skip_special_tokens=False)
    assert '"name":"get_weather"' in text and '"name":"get_time"' in text and "Be brief.\n\n## Tools" in text, text
    assert marker["<｜tool▁calls▁begin｜>"] in ids and marker["<｜tool▁sep｜>"] in ids, "the markers are not tokens"
    user = plain["tokens"].index(tok.token_to_id("<｜User｜>"))  # the turns after the system prompt are as without tools
    assert ids[0] == plain["tokens"][0] and ids[-(len(plain["tokens"]) - user):] == plain["tokens"][user:], ids
    _, none = s.post("/tokenize", {"model": MODEL, "messages": msgs, "tools": [WEATHER], "tool_choice": "none"})
    assert none["tokens"] == plain["tokens"]

    for stream in (False, True):
        kw = dict(model=MODEL, messages=msgs, max_tokens=200, temperature=0, tools=[WEATHER, CLOCK],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  extra_body=dict(return_token_ids=True))
        if not stream:
            r = client().chat.completions.create(**kw)
            c = r.choices[0]
            calls, content, finish = c.message.tool_calls, c.message.content, c.finish_reason
            prompt_ids, gen = extra(c, "prompt_token_ids"), extra(c, "token_ids")
        else:
            calls, content, finish, gen2 = {}, "", None, []
            for ch in client().chat.completions.create(stream=True, **kw):
                for d in ch.choices:
                    content += d.delta.content or ""
                    gen2 += extra(d, "token_ids") or []
                    finish = d.finish_reason or finish
                    for tc in d.delta.tool_calls or []:  # a call's first piece names it; each adds arguments
                        if tc.index not in calls:
                            assert tc.id and tc.type == "function" and tc.function.name, tc
                            calls[tc.index] = SimpleNamespace(id=tc.id, type=tc.type, function=SimpleNamespace(
                                name=tc.function.name, arguments=""))
                        else:
                            assert tc.id is None and tc.function.name is None, tc
                        calls[tc.index].function.arguments += tc.function.arguments or ""
            calls = [calls[i] for i in sorted(calls)]
            assert gen2 == gen, (gen2, gen)
        assert finish == "tool_calls" and not content, (finish, content)
        assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].type == "function", calls
        assert calls[0].function.arguments == tok.decode(gen, skip_special_tokens=False).strip(), calls
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
        assert calls[0].id.startswith("call_") and calls[0].id.endswith("_0"), calls[0].id
    # The prompt ends inside the call: the markers, "function", the name and the fence.
    forced = [marker["<｜Assistant｜>"], marker["<｜tool▁calls▁begin｜>"], marker["<｜tool▁call▁begin｜>"]]
    assert prompt_ids[len(ids) - 1:len(ids) + 2] == forced, (prompt_ids[len(ids) - 3:], forced)
    assert tok.decode(prompt_ids[len(ids) + 2:], skip_special_tokens=False) == "function<｜tool▁sep｜>get_weather\n```json\n"

    # "required": the model names one of the offered functions (its answer held to their names, then to that
    # function's parameters), greedy or sampled; one offered is named for it.
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for seed in range(4):
        r = client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, temperature=1.0, seed=seed,
                                             tools=[WEATHER, CLOCK], tool_choice="required")
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name in params and r.choices[0].message.content is None, r
        assert r.choices[0].finish_reason == "tool_calls", r
        jsonschema.validate(json.loads(calls[0].function.arguments), params[calls[0].function.name])
    # "auto": a call the model starts itself (its call marker pushed by a bias here, so calls come one after
    # another) holds an offered name, in either form the parser reads, and arguments valid under its parameters.
    cb = marker["<｜tool▁call▁begin｜>"]
    r = client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=150, temperature=1.0, seed=3,
                                         tools=[WEATHER, CLOCK], logit_bias={str(cb): 30},
                                         extra_body=dict(return_token_ids=True))
    gen = extra(r.choices[0], "token_ids")
    starts = [i for i, t in enumerate(gen) if t == cb]
    whole = 0
    for a, b in zip(starts, starts[1:]):  # a call followed by another marker: the answer was free again
        text = tok.decode(gen[a + 1:b], skip_special_tokens=False)
        m = (re.fullmatch(r"function<｜tool▁sep｜>(\w+)\n```json\n(.*)", text, re.S) or
             re.fullmatch(r"(\w+)<｜tool▁sep｜>(.*)", text, re.S))
        assert m and m.group(1) in params, text
        jsonschema.validate(json.loads(m.group(2)), params[m.group(1)])
        whole += 1
    assert whole >= 2, (whole, tok.decode(gen, skip_special_tokens=False))
    r = client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, tools=[WEATHER],
                                         tool_choice="required")
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"], r

    # A conversation with an earlier call and its result.
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "18 C, sunny"}]
    r = client().chat.completions.create(model=MODEL, messages=history, max_tokens=3, temperature=0, tools=[WEATHER],
                                         extra_body=dict(return_token_ids=True))
    pids = extra(r.choices[0], "prompt_token_ids")
    assert marker["<｜tool▁outputs▁begin｜>"] in pids and r.choices[0].finish_reason == "length", r
    assert "18 C, sunny" in tok.decode(pids, skip_special_tokens=False)

    for body, param in ((dict(tools={"a": 1}), "tools"), (dict(tools=[{"type": "function", "function": {}}]), "tools"),
                        (dict(tools=[{"type": "retrieval"}]), "tools"),
                        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
                         "tool_choice"),
                        (dict(tool_choice="required"), "tool_choice"), (dict(tools=[WEATHER], tool_choice="always"),
                                                                        "tool_choice"),
                        (dict(functions=[WEATHER["function"]]), "functions"),
                        (dict(tools=[WEATHER, WEATHER]), "tools")):
        status, e = s.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2, **body})
        assert status == 400 and e["error"]["param"] == param, (body, status, e)


class Forecast(pydantic.BaseModel):
    """Every field bounded, so that the random model's answer ends within max_tokens."""
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=10)
    unit: Literal["C", "F"]
    days: int = pydantic.Field(ge=1, le=14)
    confidence: float = pydantic.Field(gt=0, le=1)
    rain: list[bool] = pydantic.Field(max_length=3)
    span: tuple[int, int]
    note: Optional[Literal["ok", "warn"]] = None
    station: str = pydantic.Field(pattern=r"^[A-Z]{3}-\d{2}$")  # a pattern
    issued: datetime.date                                       # format "date": a calendar date
    winds: set[Literal["N", "E", "S", "W"]] = pydantic.Field(max_length=2)  # uniqueItems


def test_structured_output():
    """response_format json_schema (the SDK's own parse() with a pydantic model) and
    json_object, vLLM's guided_json, on both endpoints, streamed alike: every answer
    that ends is JSON valid under its schema (jsonschema checks it), greedy and
    sampled; what the grammar cannot hold is a 400 naming the keyword."""
    msgs = [{"role": "user", "content": "Forecast for Oslo as JSON."}]
    schema = Forecast.model_json_schema()
    for seed in range(3):
        r = client().chat.completions.parse(model=MODEL, messages=msgs, max_tokens=400, temperature=1.0, seed=seed,
                                            response_format=Forecast)
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        assert isinstance(c.message.parsed, Forecast), c.message
        jsonschema.validate(json.loads(c.message.content), schema)
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": schema, "strict": True}}
    kw = dict(model=MODEL, messages=msgs, max_tokens=400, temperature=0, response_format=fmt)
    whole = client().chat.completions.create(**kw).choices[0]
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client().chat.completions.create(stream=True, **kw)
                       if ch.choices)
    assert streamed == whole.message.content and whole.finish_reason == "stop", (streamed, whole)
    jsonschema.validate(json.loads(streamed), schema)
    # Completions, with vLLM's guided_json; json_object: an object, where it ends.
    r = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0,
                                    extra_body=dict(guided_json=schema)).choices[0]
    assert r.finish_reason == "stop", r
    jsonschema.validate(json.loads(r.text), schema)
    # vLLM's guided_choice: the answer is one of the texts, whole, greedy and sampled.
    choices = ["sunny", "rain, then sun", "sun", "雪"]
    seen = set()
    for seed in range(6):
        c = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0 if seed else 0,
                                        seed=seed, extra_body=dict(guided_choice=choices)).choices[0]
        assert c.text in choices and c.finish_reason == "stop", c
        seen.add(c.text)
    assert len(seen) >= 2, seen
    # vLLM's guided_regex / SGLang's regex: the answer is a text the pattern matches whole.
    pattern = r"(sun|rain|snow) [0-9]{1,2}(\.[0-9])?C, wind [A-Z]{1,2}"
    for seed, key in ((0, "guided_regex"), (1, "regex"), (2, "guided_regex")):
        c = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=1.0 if seed else 0,
                                        seed=seed, extra_body={key: pattern}).choices[0]
        assert re.fullmatch(pattern, c.text) and c.finish_reason == "stop", c
    c = client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=1.0, seed=3,
                                         extra_body=dict(guided_regex=pattern)).choices[0]
    assert re.fullmatch(pattern, c.message.content) and c.finish_reason == "stop", c
    # vLLM's newer spelling, structured_outputs: the same answers as its guided_* fields.
    for so, key in (({"regex": pattern}, "guided_regex"), ({"choice": choices}, "guided_choice"),
                    ({"json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}, "guided_json")):
        a = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                        extra_body=dict(structured_outputs=so)).choices[0]
        b = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                        extra_body={key: next(iter(so.values()))}).choices[0]
        assert a.text == b.text and a.finish_reason == b.finish_reason == "stop", (so, a, b)
    # vLLM's guided_grammar / SGLang's ebnf: a text the grammar derives (here a sum of products,
    # checked by Python's own reading of it: balanced, digits and operators only).
    grammar = ('root ::= expr\nexpr ::= term (("+" | "-") term){0,3}\nterm ::= [1-9] ("*" [1-9])? | "(" inner ")"\n'
               'inner ::= [1-9] (("+" | "-") [1-9]){0,3}  # bounded: the random model would nest for ever')
    for seed, key in ((0, "guided_grammar"), (1, "ebnf"), (2, "guided_grammar")):
        c = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=1.0 if seed else 0,
                                        seed=seed, extra_body={key: grammar}).choices[0]
        assert c.finish_reason == "stop" and re.fullmatch(r"[0-9+\-*()]+", c.text), c
        assert isinstance(eval(c.text, {"__builtins__": {}}), int), c.text  # (a sum of digits: safe to evaluate)
    for seed in range(2):
        r = client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=300, temperature=1.0, seed=seed,
                                             response_format={"type": "json_object"}).choices[0]
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.message.content), dict), r.message.content
    s = srv()
    for rf, words in (({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)"}}},
                       "#/pattern': regex '(?=a)' at offset 1: lookahead is not supported"),
                      ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                          "a": {"type": "number", "multipleOf": 0.25}}}}}, "#/properties/a/multipleOf"),
                      ({"type": "yaml"}, "'yaml'"), ({"type": "json_schema"}, "json_schema")):
        status, e = s.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2, "response_format": rf})
        assert status == 400 and e["error"]["param"] == "response_format" and words in e["error"]["message"], (rf, e)
    status, e = s.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2, "tools": [WEATHER],
                                                "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert status == 400 and e["error"]["param"] == "response_format", e
    for body, param, words in (({"guided_regex": "(a"}, "guided_regex", "unclosed '('"),
                               ({"regex": "a\\1"}, "regex", "backreferences"),
                               ({"guided_regex": ""}, "guided_regex", "non-empty string"),
                               ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "give one of"),
                               ({"guided_grammar": "root ::= x"}, "guided_grammar", "'x' is used but not defined"),
                               ({"ebnf": "root ::= root \"a\" | \"b\""}, "ebnf", "left recursion"),
                               ({"structured_outputs": {"regex": "(?=a)"}}, "structured_outputs", "lookahead"),
                               ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "not supported"),
                               ({"structured_outputs": {"regex": "a"}, "guided_regex": "a"}, "structured_outputs", "not both"),
                               ({"structured_outputs": "a"}, "structured_outputs", "an object"),
                               ({"guided_json": {"type": "string", "pattern": "[0-9]{5}", "maxLength": 4}}, "guided_json",
                                "no text of at most 4 characters")):
        status, e = s.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, **body})
        assert status == 400 and e["error"]["param"] == param and words in e["error"]["message"], (body, e)
    # A schema nested 100,000 deep (a raw body: Python's json recurses) is a 400, not a stack overflow.
    deep = '{"items":' * 100000 + '{}' + '}' * 100000
    status, _, e = s.request("POST", "/v1/completions", '{"model": "deepseek-v4-tiny", "prompt": "x", "max_tokens": 2, '
                             '"response_format": {"type": "json_schema", "json_schema": {"schema": ' + deep + '}}}')
    assert status == 400 and "deeper than" in e["error"]["message"], (status, e)
    assert s.get("/health")[0] == 200


def test_special_tokens_are_left_out_of_the_text():
    """An answer the model ends with EOS (here: once the grammar's one text is written, EOS is all it may
    sample) has no '<｜end▁of▁sentence｜>' in its text, vLLM's default; skip_special_tokens false keeps it."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    c = client().completions.create(**kw, extra_body=dict(guided_grammar='root ::= "ok"', return_token_ids=True)).choices[0]
    assert c.text == "ok" and c.finish_reason == "stop" and extra(c, "token_ids")[-1] == 1, c
    c = client().completions.create(**kw, extra_body=dict(guided_grammar='root ::= "ok"', skip_special_tokens=False)).choices[0]
    assert c.text == "ok<｜end▁of▁sentence｜>" and c.finish_reason == "stop", c
    status, e = srv().post("/v1/completions", dict(kw, skip_special_tokens="no"))
    assert status == 400 and e["error"]["param"] == "skip_special_tokens", e


def test_min_tokens_holds_back_stop_ids():
    g = extra(greedy(n=10).choices[0], "token_ids")
    k = next(i for i in range(2, 8) if g[i] not in g[:i])
    r = greedy(n=10, stop_token_ids=[g[k]]).choices[0]
    assert extra(r, "token_ids") == g[:k + 1] and r.finish_reason == "stop", (extra(r, "token_ids"), g)
    r = greedy(n=10, stop_token_ids=[g[k]], min_tokens=k + 3).choices[0]
    ids = extra(r, "token_ids")
    assert len(ids) >= k + 3 and ids[:k] == g[:k] and g[k] not in ids[:k + 3], (ids, g)


def test_ignore_eos_and_min_tokens_with_the_models_eos():
    g = extra(greedy(n=10).choices[0], "token_ids")
    k = next(i for i in range(2, 8) if g[i] not in g[:i])
    # The same weights under a config whose EOS id is the greedy token k.
    d = tempfile.mkdtemp(prefix="troupe-eos-")
    try:
        src = harness.model_dir(A.home)
        for f in os.listdir(src):
            if f != "config.json":
                os.symlink(os.path.join(src, f), os.path.join(d, f))
        cfg = json.load(open(os.path.join(src, "config.json")))
        cfg["eos_token_id"] = [1, g[k]]
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
        with harness.Server(A.troupe, A.home, ["--model", d, "--served-model-name", MODEL], name="eos") as s:
            def run(**kw):
                r = client(s).completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                                 extra_body=dict(return_token_ids=True, **kw))
                return extra(r.choices[0], "token_ids"), r.choices[0].finish_reason
            ids, why = run()
            assert ids == g[:k + 1] and why == "stop", (ids, why, g)
            ids, why = run(ignore_eos=True)
            assert ids == g and why == "length", (ids, why, g)
            ids, why = run(min_tokens=k + 2)
            assert len(ids) >= k + 2 and ids[:k] == g[:k] and g[k] not in ids[:k + 2], (ids, g)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_quantized_checkpoint_kept_and_dequantized_serve_the_same_tokens():
    """An FP8 checkpoint with FP4 experts (init-model --quantize fp4, DeepSeek's layout): served with its codes
    kept (the CPU backend's default) and with --weights f32 (dequantized as it loads), the same greedy tokens
    and the same logprobs, since the logits have the same bits; --weights bf16 on the CPU backend is refused."""
    d = tempfile.mkdtemp(prefix="troupe-fp4-")
    try:
        import subprocess
        subprocess.run([A.troupe, "init-model", "--preset", "tiny", "--quantize", "fp4", "--seed", "3", "--out", d],
                       check=True, capture_output=True)
        got = {}
        for weights in ("auto", "f32"):
            with harness.Server(A.troupe, A.home, ["--model", d, "--served-model-name", MODEL, "--weights", weights],
                                name="fp4-" + weights) as s:
                r = client(s).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2,
                                                 extra_body=dict(return_token_ids=True))
                c = r.choices[0]
                got[weights] = (extra(c, "token_ids"), c.logprobs.token_logprobs, c.logprobs.top_logprobs)
        assert got["auto"] == got["f32"], got
        assert len(got["auto"][0]) == 12
        bad = subprocess.run([A.troupe, "serve", "--model", d, "--weights", "bf16", "--port", "0"],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and "--weights bf16 needs --backend cuda" in bad.stderr, bad.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_models_and_health():
    models = client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client().models.retrieve(MODEL).id == MODEL
    try:
        client().models.retrieve("gpt-7")
        raise AssertionError("an unknown model was retrieved")
    except openai.NotFoundError as e:
        assert e.body["code"] == "model_not_found", e.body
    assert srv().get("/health")[0] == 200


def test_tokenize_and_detokenize():
    """vLLM's /tokenize and /detokenize: the ids a completion or chat request feeds, and their text."""
    ref = greedy(n=1).choices[0]
    s, _, b = srv().request("POST", "/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert s == 200 and b["tokens"] == extra(ref, "prompt_token_ids") and b["count"] == len(b["tokens"]), b
    assert b["max_model_len"] > 0
    s, _, plain = srv().request("POST", "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert s == 200 and plain["tokens"] == b["tokens"][1:], plain  # no BOS
    msgs = [{"role": "user", "content": "Count the pages."}]
    chat = client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0,
                                            extra_body=dict(return_token_ids=True))
    s, _, c = srv().request("POST", "/tokenize", {"model": MODEL, "messages": msgs})
    assert s == 200 and c["tokens"] == extra(chat.choices[0], "prompt_token_ids"), (c, chat.choices[0])
    s, _, d = srv().request("POST", "/detokenize", {"model": MODEL, "tokens": plain["tokens"]})
    assert s == 200 and d["prompt"] == PROMPT, d
    for path, body, param in [("/tokenize", {"prompt": 5}, "prompt"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/detokenize", {"tokens": "x"}, "tokens"), ("/tokenize", "[1", "")]:
        s, _, e = srv().request("POST", path, body)
        assert s == 400 and e["error"]["param"] == (param or None), (path, body, s, e)
    s, _, e = srv().request("POST", "/tokenize", {"model": "gpt-7", "prompt": "x"})
    assert s == 404 and e["error"]["code"] == "model_not_found", e
    assert srv().request("GET", "/tokenize")[0] == 405


def test_responses_api():
    """OpenAI's Responses API (/v1/responses) through the SDK's responses.create / stream / parse: the
    same greedy answer as the chat with its instructions as the system message, its typed stream events
    numbered in order and adding up to the answer, function tools (forced, streamed, and a conversation
    with a call and its output as input items), text.format json_schema; what needs stored responses or
    hosted tools, and chat-only parameters, are 400s naming the parameter."""
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three actors."}]
    chat = client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    inp = [{"role": "user", "content": [{"type": "input_text", "text": "Name three actors."}]}]
    r = client().responses.create(model=MODEL, instructions="You are terse.", input=inp, max_output_tokens=8,
                                  temperature=0)
    assert r.object == "response" and r.id.startswith("resp_"), r
    assert r.output_text == chat.choices[0].message.content, (r.output_text, chat.choices[0].message.content)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 8, r.usage
    assert r.instructions == "You are terse." and r.max_output_tokens == 8, r
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant", r.output
    # The same as a stream: every event numbered from 0 in order; the deltas add up to the answer.
    events = list(client().responses.create(model=MODEL, instructions="You are terse.", input=inp,
                                            max_output_tokens=8, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events))), [e.type for e in events]
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], types
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"], types
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text and events[-1].response.usage.output_tokens == 8
    # The SDK's stream helper reads the events (an answer cut short ends with response.incomplete, as OpenAI's do).
    with client().responses.stream(model=MODEL, input="Hello there", max_output_tokens=6, temperature=0) as st:
        last = list(st)[-1]
    again = client().responses.create(model=MODEL, input="Hello there", max_output_tokens=6, temperature=0)
    assert last.type == "response.incomplete" and last.response.output_text == again.output_text, (last, again)

    # Logprobs (include + top_logprobs): the chat's, on the output_text part and on each delta.
    kw = dict(model=MODEL, instructions="You are terse.", input=inp, max_output_tokens=4, temperature=0,
              top_logprobs=2, include=["message.output_text.logprobs"])
    lp = client().responses.create(**kw).output[0].content[0].logprobs
    ref = client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                           top_logprobs=2).choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 4), len(e.top_logprobs)) for e in lp] == \
        [(e.token, round(e.logprob, 4), 2) for e in ref], (lp, ref)
    deltas = [e for e in client().responses.create(stream=True, **kw) if e.type == "response.output_text.delta"]
    assert [x.token for e in deltas for x in e.logprobs] == [e.token for e in lp], deltas

    # Function tools (the flat Responses form): a forced call, whole and streamed.
    weather = {"type": "function", **WEATHER["function"]}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    for stream in (False, True):
        kw = dict(model=MODEL, input=ask, tools=[weather], max_output_tokens=200, temperature=0,
                  tool_choice={"type": "function", "name": "get_weather"})
        if not stream:
            r = client().responses.create(**kw)
            calls = [o for o in r.output if o.type == "function_call"]
        else:  # through the SDK's stream helper: its final response is the last event's
            with client().responses.stream(**kw) as st:
                events = list(st)
                r = st.get_final_response()
            calls = [o for o in r.output if o.type == "function_call"]
            assert events[-1].type == "response.completed" and events[-1].response.output == r.output, events[-1]
            args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
            assert args == calls[0].arguments, (args, calls)
            assert [e.sequence_number for e in events] == list(range(len(events)))
        assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather", r
        assert calls[0].call_id.startswith("call_") and calls[0].status == "completed", calls
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    # A conversation with the call and its output, as input items: the chat's prompt with tool_calls and tool messages.
    history = ask + [{"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                     {"type": "function_call_output", "call_id": "call_9", "output": "18 C, sunny"}]
    r = client().responses.create(model=MODEL, input=history, tools=[weather], max_output_tokens=3, temperature=0)
    chat = client().chat.completions.create(
        model=MODEL, tools=[WEATHER], max_tokens=3, temperature=0,
        messages=ask + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_9", "content": "18 C, sunny"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.output_text == chat.choices[0].message.content, (r, chat)

    # text.format json_schema through the SDK's parse() and a pydantic model.
    for seed in range(2):
        r = client().responses.parse(model=MODEL, input="Forecast for Oslo as JSON.", text_format=Forecast,
                                     max_output_tokens=400, temperature=1.0, extra_body=dict(seed=seed))
        assert r.status == "completed" and isinstance(r.output_parsed, Forecast), r
        jsonschema.validate(json.loads(r.output_text), Forecast.model_json_schema())

    s = srv()
    for body, param in ((dict(previous_response_id="resp_1"), "previous_response_id"), (dict(input=None), "input"),
                        (dict(input=[]), "input"), (dict(tools=[{"type": "web_search"}]), "tools"),
                        (dict(messages=ask), "messages"), (dict(max_tokens=3), "max_tokens"),
                        (dict(text={"format": {"type": "xml"}}), "text.format"),
                        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input"),
                        (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input"),
                        (dict(max_output_tokens=0), "max_output_tokens"), (dict(temperature="hot"), "temperature"),
                        (dict(background=True), "background"), (dict(top_logprobs=21), "top_logprobs"),
                        (dict(include="message.output_text.logprobs"), "include")):
        status, e = s.post("/v1/responses", {"model": MODEL, "input": "hi", **body})
        assert status == 400 and e["error"]["param"] == param and e["error"]["message"], (body, status, e)
    assert s.get("/health")[0] == 200


if __name__ == "__main__":
    raise SystemExit(harness.run(globals(), A.only))
