#!/usr/bin/env python3
"""Colocated and disaggregated (--prefill-workers 1 --decode-workers 1, one
process) give identical greedy tokens: the prefill worker computes the prompt
and the first token, parks the state (the five kinds of V4 state) and hands
its SequenceImage to the decode worker, which continues it. Every request
must really be handed over (no fallback to recomputation)."""
import harness

A = harness.args()
MODEL = "deepseek-v4-tiny"


def bodies():
    # Short and multi-page prompts (pages are 32 tokens; windows 32; HCA rate 16, CSA 4).
    ps = harness.distinct_prompts(6, words=8) + harness.distinct_prompts(4, words=150)
    return [{"model": MODEL, "prompt": p, "max_tokens": 20, "temperature": 0} for p in ps]


def echo_scores(s):
    """Echo with logprobs (the prompt's, computed by the prefill worker under PD) of a
    multi-page prompt, with an answer and without (max_tokens 0)."""
    out = []
    for max_tokens in (6, 0):
        status, b = s.post("/v1/completions", {"model": MODEL, "prompt": bodies()[8]["prompt"], "echo": True,
                                               "logprobs": 2, "max_tokens": max_tokens, "temperature": 0})
        assert status == 200, b
        c = b["choices"][0]
        out.append((c["text"], c["finish_reason"], c["logprobs"], b["usage"]["completion_tokens"]))
    return out


def run(extra, name):
    with harness.Server(A.troupe, A.home, extra, name=name) as s:
        r = harness.Streams(s.base_url, bodies()).join()
        assert not r.errors, r.errors
        r.echo = echo_scores(s)
        m = s.idle_pages()
        assert harness.metric(m, "troupe_leaked_pages") == 0
        return r, m


def test_colocated_and_disaggregated_give_identical_tokens():
    co, _ = run([], "colocated")
    pd, m = run(["--prefill-workers", "1", "--decode-workers", "1"], "pd")
    assert co.finish == pd.finish == ["length"] * 10, (co.finish, pd.finish)
    diff = [i for i in range(10) if co.tokens[i] != pd.tokens[i]]
    assert not diff, f"requests {diff} differ between colocated and disaggregated"
    assert co.echo == pd.echo, "echo with logprobs differs between colocated and disaggregated"
    assert pd.echo[0][3] == 6 and pd.echo[1][3] == 0 and pd.echo[1][1] == "length"
    assert len(pd.echo[0][2]["tokens"]) == len(pd.echo[1][2]["tokens"]) + 6 > 150
    assert harness.metric(m, "troupe_handoffs_total", worker="prefill-0") == 11, m
    assert harness.metric(m, "troupe_handoff_fallbacks_total") == 0
    # The prefill worker released each state after the decode worker confirmed it.
    assert harness.metric(m, "troupe_running", worker="prefill-0") == 0
    bad = harness.check_greedy(A.troupe, harness.model_dir(A.home),
                               [0] + __import__("tokenizers").Tokenizer.from_file(
                                   harness.model_dir(A.home) + "/tokenizer.json").encode(
                                   bodies()[7]["prompt"], add_special_tokens=False).ids, pd.tokens[7])
    assert not bad, f"disaggregated tokens differ from troupe forward's argmax at {bad}"


if __name__ == "__main__":
    raise SystemExit(harness.run(globals(), A.only))
