"""Tokenizer, chat rendering, the rollout engine and the trajectory record, on a tiny real transformers model."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from policy import engine, kvcache, sampling
from policy.engine import (EngineStats, RolloutState, RolloutRequest, SamplingParams, TransformersEngine, _Chunk,
                           run_episodes, sample_tokens)
from policy.sampling import draw_tokens
from policy.model import build_tiny_model, load_policy, save_policy
from policy.records import Guidance, Origin
from policy.tokenizer import ChatRenderer, build_word_tokenizer, split_inserted

WORDS = ["lookup", "answer", "(", ")", ",", ".", "e1", "e2", "e3", "mother", "boss", "start", "at", "hint", ":",
         "error", "bad", "the", "is"]


@dataclass
class _Step:
    text: str
    action: object
    observation: str
    ok: bool
    done: bool


@dataclass
class _Task:
    id: str = "t0"
    family: str = "toy"
    level: int = 1
    prompt: str = "start at e1 ."


class ToyTools:
    """Answers any turn with 'e2'; a turn starting with 'answer' ends the episode."""

    def step(self, task, text):
        done = text.strip().startswith("answer")
        return _Step(text, None, "" if done else "e2", True, done)


@pytest.fixture(scope="module")
def tok():
    return build_word_tokenizer(WORDS)


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(len(tok), hidden_size=32, layers=2, heads=2, kv_heads=1, intermediate_size=64,
                            max_positions=256, seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


def test_tokenizer_round_trip(tok):
    text = "lookup(e1, mother)"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["lookup", "(", "e1", ",", "mother", ")"]
    assert tok.decode(ids) == "lookup ( e1 , mother )"
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    assert tok.convert_ids_to_tokens(tok.encode("zebra", add_special_tokens=False)) == ["<unk>"]


def test_tokenizer_saves_and_loads_through_auto_classes(tmp_path, tok, model):
    save_policy(model, tok, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").is_file()
    m2, t2 = load_policy(tmp_path / "m")
    assert ChatRenderer(t2).prompt("a", "start at e1 .") == ChatRenderer(tok).prompt("a", "start at e1 .")
    for p, q in zip(model.parameters(), m2.parameters()):
        assert torch.equal(p, q)


def test_chat_rendering_suffixes(tok):
    r = ChatRenderer(tok)
    assert tok.convert_ids_to_tokens(r.tool_suffix("e2")) == ["<|im_start|>", "tool", "e2", "<|im_end|>",
                                                             "<|im_start|>", "assistant"]
    ids, a, b = r.tool_suffix_with_hint("e2", "hint : the boss")
    assert ids[:a] + ids[b:] == r.tool_suffix("e2")
    # the inserted span is one whole message (possibly rotated by a shared header token)
    assert sorted(tok.convert_ids_to_tokens(ids[a:b])) == sorted(
        ["<|im_start|>", "user", "hint", ":", "the", "boss", "<|im_end|>"])
    with pytest.raises(ValueError):
        split_inserted([1, 2, 3], [1, 9, 9])


def test_sampling_top_p_and_greedy():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[3.0, 2.0, -5.0, -5.0]]).repeat(200, 1)
    tok, lp = sample_tokens(logits, 1.0, 0.5, g)  # top token alone has mass > 0.5
    assert set(tok.tolist()) == {0}
    assert torch.allclose(lp, torch.log_softmax(logits, -1)[:, 0])
    tok, _ = sample_tokens(logits, 0.0, 1.0, g)
    assert set(tok.tolist()) == {0}
    tok, _ = sample_tokens(logits, 1.0, 1.0, g)
    assert set(tok.tolist()) == {0, 1} or len(set(tok.tolist())) > 1


def test_draw_tokens_is_torch_multinomial(monkeypatch):
    """The CPU sampler draws torch.multinomial's tokens and leaves the generator where torch.multinomial does, for
    all of a batch's rows or some of them, also where close calls are decided on the exact noise; bad
    probabilities fail as they do in torch."""
    g = torch.Generator().manual_seed(0)
    for near in (sampling._NEAR, 0.9):  # 0.9: nearly every row is a close call
        monkeypatch.setattr(sampling, "_NEAR", near)
        for trial in range(16):
            probs = torch.softmax(torch.randn(24, 300, generator=g) * (trial % 4), dim=-1)
            if trial % 3 == 0:
                probs[:, 50:] = 0  # as top-p leaves a row
            a, b = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
            want = torch.multinomial(probs, 1, generator=a)[:, 0]
            if trial % 2:
                rows = torch.arange(trial % 5, 24, 3)
                assert torch.equal(draw_tokens(probs[rows], b, rows, 24), want[rows])
            else:
                assert torch.equal(draw_tokens(probs, b), want)
            assert torch.equal(a.get_state(), b.get_state())
    assert sampling._fast_draw  # this torch draws the way draw_tokens reproduces
    for bad in ([[0.5, float("nan")]], [[0.0, 0.0]], [[-0.1, 1.0]]):
        with pytest.raises(RuntimeError):
            draw_tokens(torch.tensor(bad), torch.Generator())


def _requests(n, **kw):
    return [RolloutRequest(task=_Task(), env=ToyTools(), system="lookup ( e1 , mother )", group=i, **kw)
            for i in range(n)]


def test_engine_multi_turn_masks_and_logprobs(tok, model):
    eng = TransformersEngine(model, ChatRenderer(tok), batch_size=3)
    params = SamplingParams(temperature=1.0, max_tokens_per_turn=5, max_turns=3)
    trajs = eng.generate(_requests(5), params, seed=1)
    assert len(trajs) == 5
    for tr in trajs:
        assert len(tr.ids) == len(tr.origin) == len(tr.logprobs) == len(tr.turn)
        assert 1 <= tr.n_turns <= 3
        pol = [i for i, o in enumerate(tr.origin) if o == Origin.POLICY]
        assert tr.n_generated == len(pol) <= 3 * 5
        assert all(tr.logprobs[i] <= 0 for i in pol)
        assert all(tr.logprobs[i] == 0 for i, o in enumerate(tr.origin) if o != Origin.POLICY)
        ids, mask, *_ = tr.training_view()
        assert ids[: len(tr.prompt_ids)] == tr.prompt_ids and sum(mask) == len(pol)
    # the behaviour log-probs are the model's own: recompute one trajectory's with a plain forward pass
    assert _recomputed_logprobs_match(model, trajs[0])


def test_engine_is_reproducible_and_batch_size_independent(tok, model):
    params = SamplingParams(temperature=1.0, max_tokens_per_turn=5, max_turns=3)
    a = TransformersEngine(model, ChatRenderer(tok), batch_size=8).generate(_requests(4), params, seed=7)
    b = TransformersEngine(model, ChatRenderer(tok), batch_size=8).generate(_requests(4), params, seed=7)
    assert [t.ids for t in a] == [t.ids for t in b]
    c = TransformersEngine(model, ChatRenderer(tok), batch_size=8).generate(_requests(4), params, seed=8)
    assert [t.ids for t in a] != [t.ids for t in c]


def test_engine_token_cap_is_never_exceeded(tok, model):
    eng = TransformersEngine(model, ChatRenderer(tok))
    params = SamplingParams(temperature=1.0, max_tokens_per_turn=5, max_turns=3)
    trajs = eng.generate(_requests(6), params, seed=3, max_new_tokens=20)
    assert sum(t.n_generated for t in trajs) <= 20
    assert any(t.truncated for t in trajs)


def test_engine_continues_from_prefix_and_marks_guidance(tok, model):
    r = ChatRenderer(tok)
    eng = TransformersEngine(model, r)
    params = SamplingParams(temperature=1.0, max_tokens_per_turn=4, max_turns=4)
    # force a 2-turn prefix: inject 'lookup(e1, mother)' twice through guided steps
    (src,) = eng.generate(_requests(1, guidance=Guidance(inject="lookup(e1, mother)")), params, seed=0)
    assert src.origin[0] == Origin.INJECTED and src.steps[0].text == "lookup(e1, mother)"
    assert src.n_turns >= 1
    (br,) = eng.generate([RolloutRequest(task=_Task(), env=ToyTools(), system="lookup ( e1 , mother )",
                                         prefix=src, prefix_turns=1, guidance=Guidance(hint="hint : the boss"))],
                         params, seed=5)
    n_pre = sum(1 for t in src.turn if t < 1)
    assert br.ids[: n_pre - 6] == src.ids[: n_pre - 6]  # the copied turn (its tool suffix is re-rendered)
    assert br.prefix_turns == 1 and br.steps[0] is src.steps[0]
    guid = [i for i, o in enumerate(br.origin) if o == Origin.GUIDANCE]
    assert sorted(tok.convert_ids_to_tokens([br.ids[i] for i in guid])) == sorted(
        ["<|im_start|>", "user", "hint", ":", "the", "boss", "<|im_end|>"])
    ids, mask, *_ = br.training_view()
    # guidance stripped from the training context: exactly the unguided rendering of the same turns
    assert ids == br.train_prompt_ids + [t for t, o in zip(br.ids, br.origin) if o != Origin.GUIDANCE]
    assert len(ids) == len(br.train_prompt_ids) + len(br.ids) - 7
    assert br.n_generated == sum(1 for o, t in zip(br.origin, br.turn) if o == Origin.POLICY and t >= 1)
    # a plan goes into the sampled prompt only
    (pl,) = eng.generate(_requests(1, guidance=Guidance(plan="hint : lookup ( e1 , mother )")), params, seed=0)
    assert len(pl.prompt_ids) > len(pl.train_prompt_ids)
    assert pl.train_prompt_ids == r.prompt("lookup ( e1 , mother )", "start at e1 .")


class EndsAfter(ToyTools):
    """Ends the episode at its ``n``-th turn, whatever the turn says."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def step(self, task, text):
        self.calls += 1
        return _Step(text, None, "e2 e3" if self.calls % 2 else "e2", True, self.calls >= self.n)


def _recomputed_logprobs_match(model, tr) -> bool:
    """The behaviour log-probs of ``tr``'s sampled tokens against one plain forward pass over its context."""
    ids = tr.prompt_ids + tr.ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    n = len(tr.prompt_ids)
    m = torch.tensor([o == Origin.POLICY for o in tr.origin], dtype=torch.bool)
    return bool(torch.allclose(ref[n - 1:][m], torch.tensor(tr.logprobs)[m], atol=1e-4))


def test_engine_cache_across_turns_matches_a_full_forward_pass(tok, model):
    """The KV cache is kept across turns, with masked holes where rows sat out and rows dropped when their
    episode ends: every sampled token's log-prob must still be the one the unpadded context gives."""
    r = ChatRenderer(tok)
    params = SamplingParams(temperature=1.0, max_tokens_per_turn=4, max_turns=5)
    (src,) = TransformersEngine(model, r).generate(_requests(1, guidance=Guidance(inject="lookup(e1, mother)")),
                                                   params, seed=0)
    # plain rollouts ending at different turns, a branch with a hint and a plan: contexts of different lengths
    reqs = [RolloutRequest(task=_Task(), env=EndsAfter(1 + i % 5), system="lookup ( e1 , mother )", group=i)
            for i in range(7)]
    reqs.append(RolloutRequest(task=_Task(), env=ToyTools(), system="lookup ( e1 , mother )", prefix=src,
                               prefix_turns=1, guidance=Guidance(hint="hint : the boss")))
    reqs.append(RolloutRequest(task=_Task(), env=ToyTools(), system="lookup ( e1 , mother )",
                               guidance=Guidance(plan="hint : lookup ( e1 , mother )")))
    for batch_size in (4, 16):
        for q in reqs:
            if isinstance(q.env, EndsAfter):
                q.env.calls = 0
        trajs = TransformersEngine(model, r, batch_size=batch_size).generate(reqs, params, seed=11)
        assert len({t.n_turns for t in trajs}) >= 4  # episodes ended at different turns: rows were dropped
        assert all(_recomputed_logprobs_match(model, t) for t in trajs)


#: How far apart two computations of the same log-probs or logits may be when they ran on batches of other
#: shapes (a decode step on some rows of a chunk, one row without a cache): the same to the bit with some CPUs'
#: BLAS, a float rounding apart with others, whose kernels round a batch of another size differently (up to
#: about 1e-6 measured). A row's logits taken from the wrong row, or a wrong cache, are off by far more.
TOL = 1e-5
#: A draw closer than this to a tie (the gap between the two largest logs of what it takes the argmax of) may go
#: either way within ``TOL``: logits within ``TOL`` move that gap by at most 4 TOL / temperature (< 1e-4 at 0.7).
NEAR_TIE = 1e-4


def _margins(logits, temperature, top_p, generator, rows=None, batch=None):
    """How far from a tie each row's draw by :func:`sample_tokens` is: the gap, in log space, between the
    largest and the second largest of what it takes the argmax of (the log-probs when greedy; otherwise
    log p - log q, with q the Exp(1) noise torch.multinomial draws, which ``draw_tokens`` reproduces). Read from
    a copy of the generator, so the draw itself is left as it is."""
    logp = torch.log_softmax(logits.double() / (temperature if temperature > 0 else 1.0), dim=-1)
    if temperature > 0:
        assert top_p >= 1.0  # (no top-p mask here)
        g = torch.Generator(device=generator.device)
        g.set_state(generator.get_state())
        u = torch.empty((logits.shape[0] if rows is None else batch, logits.shape[1]), dtype=torch.float64)
        u = u.uniform_(generator=g)
        logp = logp - torch.log(-torch.log1p(-(u if rows is None else u[rows])))
    top = logp.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def _recorded(draws: list):
    """The engine's ``sample_tokens``, recording each draw: (tokens, log-probs, distance from a tie) per row."""
    def sample(logits, temperature, top_p, generator, rows=None, batch=None):
        margin = _margins(logits, temperature, top_p, generator, rows, batch)
        tok, lp = sample_tokens(logits, temperature, top_p, generator, rows, batch)
        draws.append((tok.cpu(), lp.cpu(), margin.cpu()))
        return tok, lp
    return sample


def _same_draws(want: list, got: list) -> bool:
    """Two runs' draws (as :func:`_recorded` keeps them) give the same tokens with log-probs within ``TOL``,
    draw by draw, up to the first draw where a row's token differs, which must be a near tie (the logits within
    ``TOL`` may decide it either way; from there on the runs differ). Whether all of them agreed."""
    for i, ((wt, wl, wm), (gt, gl, gm)) in enumerate(zip(want, got)):
        assert wt.shape == gt.shape, f"draw {i}: {len(wt)} rows against {len(gt)}"  # the same rows sampled
        same = wt == gt
        torch.testing.assert_close(gl[same], wl[same], rtol=TOL, atol=TOL, msg=lambda m: f"draw {i}: {m}")
        if not bool(same.all()):
            assert sampling._draws_like_torch()  # the noise _margins read is the noise torch.multinomial drew
            near = torch.minimum(wm, gm)[~same]
            assert bool((near < NEAR_TIE).all()), f"draw {i}: tokens differ {near.tolist()} from a tie"
            return False
    assert len(want) == len(got)
    return True


def _assert_same_trajectories(want, got) -> None:
    """Token for token the same trajectories, their log-probs within ``TOL``."""
    for a, b in zip(want, got, strict=True):
        assert (a.ids, a.origin, a.turn, a.turn_texts, a.truncated, a.done, a.n_generated) == \
               (b.ids, b.origin, b.turn, b.turn_texts, b.truncated, b.done, b.n_generated)
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=TOL, atol=TOL)


def _reference_generate(model, renderer, requests, params, seed, batch_size, max_new_tokens=None, draws=None):
    """The transformers engine's sampling written out plainly, to check the engine against.

    Episodes go in chunks of ``batch_size``; in each turn, each decode step gives every row of the chunk whose
    episode is open a token: a row still in its turn gets one from its own logits, recomputed by a forward pass
    over its whole context (no cache, no padding, no other rows), and a row that ended its turn gets one it
    never uses, because the engine's generator draws for the whole chunk (``torch.multinomial`` over every row,
    with any distribution for those rows). The multi-turn loop (prompts, tools, guidance, budget) is the one every
    engine shares, ``run_episodes``. ``draws`` collects the draws of the rows still in their turn, as
    :func:`_recorded` does the engine's."""
    gen = torch.Generator().manual_seed(seed)
    episodes = [RolloutState(q, renderer) for q in requests]
    chunks = [episodes[i:i + batch_size] for i in range(0, len(episodes), batch_size)]
    eot, vocab = renderer.end_of_turn, model.config.vocab_size

    def turn(rows, budget):
        sampled = [[] for _ in rows]
        alive, cut = [True] * len(rows), [False] * len(rows)
        for _ in range(params.max_tokens_per_turn):
            n_alive = sum(alive)
            if n_alive == 0:
                break
            if budget[0] < n_alive:
                cut = list(alive)
                break
            logits = torch.zeros(len(rows), vocab)
            for b, e in enumerate(rows):
                if alive[b]:
                    ids = torch.tensor([e.context() + [t for t, _ in sampled[b]]])
                    logits[b] = model(input_ids=ids).logits[0, -1]
            t = params.temperature if params.temperature > 0 else 1.0
            logp = torch.log_softmax(logits / t, dim=-1)
            at = torch.tensor([b for b in range(len(rows)) if alive[b]])
            if draws is not None:
                margin = _margins(logits[at], params.temperature, params.top_p, gen, at, len(rows))
            if params.temperature > 0:
                tok = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
            else:
                tok = logp.argmax(-1)
            if draws is not None:
                draws.append((tok[at], logp[at, tok[at]], margin))
            for b in range(len(rows)):
                if alive[b]:
                    sampled[b].append((int(tok[b]), float(logp[b, tok[b]])))
                    alive[b] = int(tok[b]) != eot
            budget[0] -= n_alive
        for b, e in enumerate(rows):
            n = e.traj.n_turns
            for t, lp in sampled[b]:
                e.push(t, Origin.POLICY, lp, n)
            e.traj.truncated |= cut[b]
            if alive[b]:
                e.push(eot, Origin.TOOL, 0.0, n)
            e.pending_text = renderer.decode([t for t, _ in sampled[b] if t != eot])

    def sample_turn(active, budget):
        for ch in chunks:
            rows = [e for e in ch if not e.finished]
            if rows:
                turn(rows, budget)

    with torch.no_grad():
        return run_episodes(episodes, renderer, params, max_new_tokens, sample_turn, EngineStats())


def test_engine_samples_what_a_plain_per_step_decode_samples(tok, model, monkeypatch):
    """Every trajectory the engine returns (tokens, log-probs, origins, turns, ends) is the one the plain decode
    above gives: with temperature 1 and 0.7 and greedy, a token budget that cuts turns, chunks of 1, 4 and many
    episodes, guided steps, hints, plans and a branch from a prefix. The model ends its turns at many different
    steps, so the engine's decode steps do leave out rows that ended their turn. The plain decode computes each
    row's logits on a batch of one, so they are a float rounding away from the engine's: the log-probs agree
    within ``TOL``, and a draw that close to a tie may go the other way (:func:`_same_draws`)."""
    hot = copy.deepcopy(model)
    with torch.no_grad():
        hot.model.embed_tokens.weight[tok.eos_token_id] *= 40
    r = ChatRenderer(tok)
    (src,) = TransformersEngine(model, r).generate(_requests(1, guidance=Guidance(inject="lookup(e1, mother)")),
                                                   SamplingParams(1.0, max_tokens_per_turn=4, max_turns=4), seed=0)

    def requests(n):
        out = [RolloutRequest(task=_Task(), env=EndsAfter(2 + i % 3), system="lookup ( e1 , mother )", group=i)
               for i in range(n)]
        out[1:4] = [RolloutRequest(task=_Task(), env=ToyTools(), system="lookup ( e1 , mother )", prefix=src,
                                   prefix_turns=1, guidance=Guidance(hint="hint : the boss")),
                    RolloutRequest(task=_Task(), env=ToyTools(), system="lookup ( e1 , mother )",
                                   guidance=Guidance(plan="hint : lookup ( e1 , mother )")),
                    RolloutRequest(task=_Task(), env=EndsAfter(3), system="lookup ( e1 , mother )",
                                   guidance=Guidance(inject="lookup(e1, mother)"))]
        return out

    for params, n, budget, batch_size in [(SamplingParams(1.0, max_tokens_per_turn=8, max_turns=4), 40, None, 40),
                                          (SamplingParams(0.7, max_tokens_per_turn=8, max_turns=4), 40, 250, 36),
                                          (SamplingParams(0.0, max_tokens_per_turn=6, max_turns=3), 8, None, 4),
                                          (SamplingParams(1.0, max_tokens_per_turn=6, max_turns=3), 5, 40, 1)]:
        want_draws, got_draws = [], []
        want = _reference_generate(hot, r, requests(n), params, 3, batch_size, budget, want_draws)
        eng = TransformersEngine(hot, r, batch_size=batch_size)
        with monkeypatch.context() as m:
            m.setattr(engine, "sample_tokens", _recorded(got_draws))
            got = eng.generate(requests(n), params, seed=3, max_new_tokens=budget)
        if batch_size == 40:  # some decode steps did leave rows out
            whole = TransformersEngine(hot, r, batch_size=batch_size, split_steps=False)
            whole.generate(requests(n), params, seed=3, max_new_tokens=budget)
            assert eng.stats.decode_rows < whole.stats.decode_rows
        assert sum(t.n_generated for t in got) > n
        if _same_draws(want_draws, got_draws):
            _assert_same_trajectories(want, got)


def test_engine_split_steps_change_no_trajectory(tok, model, monkeypatch):
    """Decode steps that leave out the rows which ended their turn (their cache rows split off and merged back),
    the cache that grows in place and the CPU sampler are optimisations only: every trajectory, token for token
    and log-prob for log-prob, is the one the plain path gives (every row in every step of a DynamicCache,
    torch.multinomial drawing), with temperature, greedy, a token budget, chunks and guidance. A step on fewer
    rows may round the logits differently on some CPUs: the log-probs agree within ``TOL``, and a draw that
    close to a tie may go the other way (:func:`_same_draws`)."""
    hot = copy.deepcopy(model)
    with torch.no_grad():  # turns end at different steps, most of them early, so steps do get split
        hot.model.embed_tokens.weight[tok.eos_token_id] *= 40
    r = ChatRenderer(tok)
    (src,) = TransformersEngine(model, r).generate(_requests(1, guidance=Guidance(inject="lookup(e1, mother)")),
                                                   SamplingParams(1.0, max_tokens_per_turn=4, max_turns=4), seed=0)

    def requests():
        out = [RolloutRequest(task=_Task(), env=EndsAfter(2 + i % 3), system="lookup ( e1 , mother )", group=i)
               for i in range(44)]
        out += [RolloutRequest(task=_Task(), env=ToyTools(), system="lookup ( e1 , mother )", prefix=src,
                               prefix_turns=1, guidance=Guidance(hint="hint : the boss")),
                RolloutRequest(task=_Task(), env=ToyTools(), system="lookup ( e1 , mother )",
                               guidance=Guidance(plan="hint : lookup ( e1 , mother )")),
                RolloutRequest(task=_Task(), env=EndsAfter(3), system="lookup ( e1 , mother )",
                               guidance=Guidance(inject="lookup(e1, mother)"))]
        return out

    for params, budget, batch_size in [(SamplingParams(1.0, max_tokens_per_turn=8, max_turns=4), None, 47),
                                       (SamplingParams(0.7, max_tokens_per_turn=8, max_turns=4), 400, 36),
                                       (SamplingParams(0.0, max_tokens_per_turn=8, max_turns=4), None, 47)]:
        want_draws, got_draws = [], []
        with monkeypatch.context() as m:
            m.setattr(sampling, "_fast_draw", False)
            m.setattr(kvcache, "DynamicLayer", None)  # the model's own DynamicCache, which cannot be split
            m.setattr(engine, "sample_tokens", _recorded(want_draws))
            plain = TransformersEngine(hot, r, batch_size=batch_size)
            want = plain.generate(requests(), params, seed=5, max_new_tokens=budget)
        eng = TransformersEngine(hot, r, batch_size=batch_size)
        with monkeypatch.context() as m:
            m.setattr(engine, "sample_tokens", _recorded(got_draws))
            got = eng.generate(requests(), params, seed=5, max_new_tokens=budget)
        if params.temperature > 0:  # (greedy, this model never ends a turn early)
            assert eng.stats.decode_rows < plain.stats.decode_rows  # some steps did leave rows out
        if _same_draws(want_draws, got_draws):
            _assert_same_trajectories(want, got)


def test_draws_may_part_only_at_a_near_tie():
    """The comparison the two tests above make: log-probs within ``TOL``; a token that differs is accepted only
    at a draw within ``NEAR_TIE`` of a tie, and nothing after it is compared."""
    t, lp, far = torch.tensor([3, 5]), torch.tensor([-1.0, -2.0]), torch.tensor([0.5, 0.5])
    assert _same_draws([(t, lp, far)] * 2, [(t, lp + 1e-6, far)] * 2)
    with pytest.raises(AssertionError):
        _same_draws([(t, lp, far)], [(t, lp + 1e-3, far)])
    with pytest.raises(AssertionError):
        _same_draws([(t, lp, far)], [(torch.tensor([3, 6]), lp, far)])
    near = torch.tensor([0.5, NEAR_TIE / 2])
    assert not _same_draws([(t, lp, near), (t, lp, far)], [(torch.tensor([3, 6]), lp, near), (t, lp - 1, far)])
    with pytest.raises(AssertionError):  # the rows that did not part still agree
        _same_draws([(t, lp, near)], [(torch.tensor([3, 6]), lp - 1, near)])


def test_grouped_heads_in_place_change_no_logit(tok, model):
    """While the engine samples, attention reads grouped key/value heads in place instead of copying them (SDPA's
    enable_gqa): with a padding mask, every real position's logits are the copying path's (bit for bit on the CPUs
    measured; within ``TOL``, since another CPU's kernels may round the two paths differently), and the model's
    attention implementation is back to sdpa afterwards."""
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped heads
    ids = torch.randint(4, len(tok), (6, 10), generator=torch.Generator().manual_seed(0))
    attn = torch.ones(6, 10, dtype=torch.long)
    attn[3:, :4] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=attn).logits
        with kvcache.grouped_heads_in_place(model):
            assert model.config._attn_implementation == kvcache.IN_PLACE_GQA
            got = model(input_ids=ids, attention_mask=attn).logits
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got[attn.bool()], want[attn.bool()], rtol=TOL, atol=TOL)


def test_split_step_logits_are_the_whole_chunks(tok, model):
    """A decode step on rows split off a chunk gives each row the logits the whole chunk's step gives it (to the
    bit with some CPUs' BLAS, within ``TOL`` with any), also when none of the rows still sampling has a masked
    column: transformers would then drop the mask and take another attention path, so a split keeps a row that
    sits the step out."""
    eng = TransformersEngine(model, ChatRenderer(tok))
    g = torch.Generator().manual_seed(0)
    B, S = 40, 12
    ids = torch.randint(4, len(tok), (B, S), generator=g)
    attn = torch.ones(B, S, dtype=torch.long)
    attn[20:, :3] = 0  # rows 20.. are left-padded; rows 0..19 have no masked column
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    alive = torch.zeros(B, dtype=torch.bool)
    alive[:17] = True  # 17 rows still sample, all without a hole
    step_in, step_pos = torch.randint(4, len(tok), (B, 1), generator=g), pos[:, -1:] + 1
    with torch.no_grad():
        whole = _Chunk([None] * B)
        eng._forward(whole, ids, attn, pos, room=4)
        part = _Chunk([None] * B)
        eng._forward(part, ids, attn, pos, room=4)
        sub, rows = eng._step_rows(part, None, None, alive, room=4)
        assert sub is not None and 17 < len(rows) < B
        want = eng._forward(whole, step_in, alive.long()[:, None], step_pos)[:17]
        got = eng._forward(sub, step_in[rows], alive.long()[rows, None], step_pos[rows])[:17]
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    assert not torch.allclose(got[1:], want[:-1], rtol=TOL, atol=TOL)  # rows' logits are far apart from each other


def _wave(kind, n, offset=0, src=None):
    """Requests of different shapes: episodes that end at different turns (their tool observations of two lengths),
    a hint, a plan, an injected step and (from ``src``) a branch after its first turn."""
    sysm = "lookup ( e1 , mother )"
    out = [RolloutRequest(task=_Task(), env=EndsAfter(1 + (i + offset) % 4), system=sysm, group=offset + i)
           for i in range(n)]
    if kind == "guided":
        out[0] = RolloutRequest(task=_Task(), env=EndsAfter(3), system=sysm,
                                guidance=Guidance(hint="hint : the boss"))
        out[1] = RolloutRequest(task=_Task(), env=ToyTools(), system=sysm,
                                guidance=Guidance(plan="hint : lookup ( e1 , mother )"))
        out[2] = RolloutRequest(task=_Task(), env=EndsAfter(3), system=sysm,
                                guidance=Guidance(inject="lookup(e1, mother)"))
        if src is not None:
            out[3] = RolloutRequest(task=_Task(), env=ToyTools(), system=sysm, prefix=src, prefix_turns=1,
                                    guidance=Guidance(hint="hint : the boss"))
    return out


def _same_trajectories(got, want):
    for a, b in zip(got, want, strict=True):
        assert (a.ids, a.origin, a.turn, a.turn_texts, a.truncated, a.done, a.n_generated, a.prompt_ids) == \
               (b.ids, b.origin, b.turn, b.turn_texts, b.truncated, b.done, b.n_generated, b.prompt_ids)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5)


def _run_waves(stream, waves):
    """Add ``waves[0]``, then each next wave after one more turn; run to the end. The trajectories per wave, and
    how many chunks the stream had right after each later wave joined."""
    handles, done, chunks = [stream.add(waves[0])], {}, []
    for w in waves[1:]:
        for h, tr in stream.advance():
            assert h not in done
            done[h] = tr
        handles.append(stream.add(w))
        chunks.append(len(getattr(stream, "chunks", [])))
    while stream.open:
        for h, tr in stream.advance():
            assert h not in done
            done[h] = tr
    assert sorted(done) == list(range(sum(len(w) for w in waves)))
    return [[done[h] for h in hs] for hs in handles], chunks


@pytest.mark.parametrize("plain_cache", [False, True])
def test_stream_rows_that_join_a_running_chunk_sample_what_they_sample_alone(tok, model, monkeypatch, plain_cache):
    """Greedy requests added to a running stream after its first and second turns join its chunk as new rows
    (their cache rows masked, their prompts prefilled with the others' tool observations) and decode the tokens
    the same requests decode generated alone; the episodes already running are not disturbed either. Log-probs
    agree to float tolerance (the batch shapes differ, so the sums round differently); tokens are exact: greedy,
    and on this model and these prompts no two top logits lie within that tolerance of each other. With the
    in-place growing cache and with the model's own DynamicCache."""
    if plain_cache:
        monkeypatch.setattr(kvcache, "DynamicLayer", None)
    r = ChatRenderer(tok)
    params = SamplingParams(0.0, max_tokens_per_turn=5, max_turns=5)
    (src,) = TransformersEngine(model, r).generate(_requests(1, guidance=Guidance(inject="lookup(e1, mother)")),
                                                   SamplingParams(1.0, max_tokens_per_turn=4, max_turns=4), seed=0)
    waves = lambda: [_wave("plain", 7), _wave("guided", 5, 7, src), _wave("plain", 4, 12)]  # noqa: E731
    eng = TransformersEngine(model, r, batch_size=64)
    got, chunks = _run_waves(eng.stream(params, seed=0), waves())
    assert chunks == [1, 1]  # every wave joined the one running chunk
    for g, w in zip(got, waves(), strict=True):
        _same_trajectories(g, TransformersEngine(model, r).generate(w, params, seed=0))
    assert len({t.n_turns for ts in got for t in ts}) >= 3  # rows left the chunk at different turns


@pytest.mark.parametrize("plain_cache", [False, True])
@pytest.mark.parametrize("prefill,long_cache", [(True, True), (True, False), (False, True)])
def test_joined_rows_get_the_next_token_logits_they_get_alone(tok, model, monkeypatch, plain_cache, prefill,
                                                             long_cache):
    """Rows added to a chunk whose cache holds other rows' turns get the next-token logits they get without the
    other group, and so do the other rows: with their contexts prefilled into columns of the cache they are masked
    on (no column added where the cache holds as many as a joined context, else as many as are missing), or fed
    in one forward with the other rows' next tokens, left-padded together."""
    if plain_cache:
        monkeypatch.setattr(kvcache, "DynamicLayer", None)
    r = ChatRenderer(tok)
    eng = TransformersEngine(model, r)
    ids = [tok.convert_tokens_to_ids(w) for w in ["lookup", "(", "e1", ",", "mother", ")", "e2", "e3"]]
    extra = [ids * 2, ids[:2]] if long_cache else [ids[:2]]

    def fed(episodes):  # a chunk of ``episodes``: their prompts fed, then each part of ``extra`` but the last
        ch = _Chunk(episodes)
        for part in extra:
            eng._feed_pending(ch, "cpu", 4)
            for e in episodes:
                e.traj.ids += part
        return ch

    with torch.no_grad():
        ch = fed([RolloutState(q, r) for q in _wave("plain", 5)])
        n = ch.attn.shape[1]
        assert ch.join([RolloutState(q, r) for q in _wave("guided", 4, 5)]) and len(ch.eps) == 9
        prompts = [len(e.context()) for e in ch.eps[5:]]
        assert (max(prompts) - 1 <= n) == long_cache
        if prefill:
            eng._prefill_joined(ch, "cpu")
            assert ch.fed[5:] == [p - 1 for p in prompts] and ch.attn.shape[1] == max(n, max(prompts) - 1)
            n = ch.attn.shape[1]
        got = eng._feed_pending(ch, "cpu", 4)
        assert ch.attn.shape[1] == n + (len(extra[-1]) if prefill else max(prompts))
        want_old = eng._feed_pending(fed([RolloutState(q, r) for q in _wave("plain", 5)]), "cpu", 4)
        want_new = eng._feed_pending(_Chunk([RolloutState(q, r) for q in _wave("guided", 4, 5)]), "cpu", 4)
    assert ch.roomy is not plain_cache
    torch.testing.assert_close(got[:5], want_old, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[5:], want_new, rtol=1e-5, atol=1e-5)


def test_stream_split_steps_with_joined_rows_change_no_trajectory(tok, model, monkeypatch):
    """Rows that joined a running chunk take part in the decode steps that leave out rows which ended their turn:
    sampling at temperature 1, with waves that join a chunk and overflow it into a new one, every trajectory is
    the one the plain path gives (every row in every step of a DynamicCache, torch.multinomial drawing): the same
    tokens, and log-probs to float tolerance (CPU attention on several threads rounds a row differently in a
    batch of another size)."""
    hot = copy.deepcopy(model)
    with torch.no_grad():  # turns end at different steps, most of them early, so steps do get split
        hot.model.embed_tokens.weight[tok.eos_token_id] *= 40
    r = ChatRenderer(tok)
    params = SamplingParams(1.0, max_tokens_per_turn=8, max_turns=4)
    (src,) = TransformersEngine(model, r).generate(_requests(1, guidance=Guidance(inject="lookup(e1, mother)")),
                                                   SamplingParams(1.0, max_tokens_per_turn=4, max_turns=4), seed=0)
    waves = lambda: [_wave("plain", 30), _wave("guided", 17, 30, src), _wave("plain", 24, 47)]  # noqa: E731
    with monkeypatch.context() as m:
        m.setattr(sampling, "_fast_draw", False)
        m.setattr(kvcache, "DynamicLayer", None)
        plain = TransformersEngine(hot, r, batch_size=40)
        want, want_chunks = _run_waves(plain.stream(params, seed=5), waves())
    eng = TransformersEngine(hot, r, batch_size=40)
    got, chunks = _run_waves(eng.stream(params, seed=5), waves())
    assert chunks == want_chunks == [1, 2]  # the second wave filled the chunk, the third spilled over
    assert eng.stats.decode_rows < plain.stats.decode_rows  # some steps did leave rows out
    for g, w in zip(got, want, strict=True):
        _same_trajectories(g, w)
    assert all(_recomputed_logprobs_match(hot, t) for ts in got for t in ts)


def test_stream_shares_its_token_budget_and_returns_each_episode_once(tok, model):
    r = ChatRenderer(tok)
    params = SamplingParams(1.0, max_tokens_per_turn=5, max_turns=3)
    eng = TransformersEngine(model, r, batch_size=4)
    with eng.stream(params, seed=3, max_new_tokens=60) as s:
        assert s.advance() == [] and s.open == 0  # nothing added yet
        first = s.add(_requests(6))
        # an injected step that ends its episode at once: returned by the next turn, without sampling
        ended = s.add([RolloutRequest(task=_Task(), env=EndsAfter(1), system="x",
                                      guidance=Guidance(inject="lookup(e1, mother)"))])
        assert first == list(range(6)) and ended == [6] and s.open == 7
        done = dict(s.advance())
        assert 6 in done and done[6].n_generated == 0 and done[6].done
        later = s.add(_requests(6))
        assert later == list(range(7, 13))
        while s.open:
            out = s.advance()
            assert not set(h for h, _ in out) & set(done)
            done.update(out)
        assert s.advance() == []
        assert sorted(done) == list(range(13))
        assert sum(t.n_generated for t in done.values()) <= 60 and eng.stats.generated_tokens <= 60
        assert s.tokens_left == 60 - eng.stats.generated_tokens >= 0
        assert any(done[h].truncated for h in later)
        # more episodes than tokens left: they all end truncated at the next turn, having sampled nothing
        hs = s.add(_requests(s.tokens_left + 1))
        assert [(x, t.truncated, t.n_generated) for x, t in s.advance()] == [(h, True, 0) for h in hs]
        assert s.open == 0 and eng.stats.generated_tokens <= 60
    with pytest.raises(RuntimeError):
        s.add(_requests(1))


def test_a_request_at_its_own_temperature_samples_from_that_distribution_and_changes_no_other_row(tok, model):
    params = SamplingParams(temperature=1.0, max_tokens_per_turn=5, max_turns=3)
    eng = TransformersEngine(model, ChatRenderer(tok), batch_size=8)
    plain = eng.generate(_requests(4), params, seed=3)
    reqs = _requests(4)
    reqs[1].temperature, reqs[2].temperature = 0.3, 2.5
    mixed = eng.generate(reqs, params, seed=3)
    # the generator draws for every row alike: the rows at the batch's temperature sample what they sampled before
    _assert_same_trajectories([plain[0], plain[3]], [mixed[0], mixed[3]])
    assert [t.temperature for t in mixed] == [None, 0.3, 2.5, None]
    # the others record the log-prob of the distribution they were drawn from: log softmax(logits / T)
    for tr, temp in ((mixed[1], 0.3), (mixed[2], 2.5)):
        ids = tr.prompt_ids + tr.ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        n = len(tr.prompt_ids)
        m = torch.tensor([o == Origin.POLICY for o in tr.origin], dtype=torch.bool)
        for t, ok in ((temp, True), (1.0, False)):
            ref = torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
            assert bool(torch.allclose(ref[n - 1:][m], torch.tensor(tr.logprobs)[m], atol=1e-4)) == ok
    with pytest.raises(ValueError, match="temperatures must be > 0"):
        reqs[1].temperature = 0.0
        eng.generate(reqs, params, seed=3)
