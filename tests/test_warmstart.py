"""Warm-start demonstrations: the action guide solves the task; the imperfect demonstrator errs once, consistently."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from processes import child_env, run
from policy.tokenizer import ChatRenderer, build_word_tokenizer
from rail.envs import family_class, make_env
from rail.policy_setup import demonstration, reference_trajectory, vocabulary

ROOT = Path(__file__).resolve().parents[1]
CIPHER = "experiments.my_env:CipherEnv"
ALTS = {"lookup": ["mother", "father", "boss", "friend"], "calc": ["+", "-", "*"]}  # kin calls lookup too


@pytest.fixture(scope="module")
def setup():
    envs = {f: make_env(f, 0) for f in ("lookup", "calc", "kin")}
    return envs, ChatRenderer(build_word_tokenizer(vocabulary(envs)))


@pytest.mark.parametrize("family", ["lookup", "calc", "kin"])
def test_reference_trajectory_solves_and_trains_only_actions(setup, family):
    envs, r = setup
    (task,) = envs[family].sample_tasks(np.random.default_rng(0), [3], 1)
    tr = reference_trajectory(envs[family], task, r)
    assert tr.reward == 1.0 and tr.done and tr.rubric.first_violated is None
    ids, mask, *_ = tr.training_view()
    trained = r.decode([i for i, m in zip(ids, mask) if m])
    assert trained.replace(" ", "") == "".join(a.render() for a in task.action_guide).replace(" ", "")


@pytest.mark.parametrize("family", ["lookup", "calc", "kin"])
def test_imperfect_demonstrator_errs_once_then_stays_consistent(setup, family):
    envs, r = setup
    rng = np.random.default_rng(1)
    assert demonstration(envs[family].sample_tasks(rng, [2], 1)[0], rng, 0.0, ALTS) is not None
    checked = 0
    for _ in range(40):
        (task,) = envs[family].sample_tasks(rng, [3], 1)
        assert demonstration(task, rng, 0.0, ALTS) == list(task.action_guide)
        acts = demonstration(task, rng, 1.0, ALTS)
        diff = [i for i, (a, b) in enumerate(zip(acts, task.action_guide)) if a.args[1:2] != b.args[1:2]]
        assert len(diff) == 1
        tr = reference_trajectory(envs[family], task, r, actions=acts)
        if not all(s.ok for s in tr.steps):
            continue  # calc left its range; warm start falls back to the guide for these
        checked += 1
        obs = [s.observation for s in tr.steps]
        for t, s in enumerate(tr.steps[1:], start=1):  # every later step chains from the previous result
            assert s.action.args[0] == obs[t - 1]
        assert tr.rubric.first_violated == diff[0]
    assert checked >= 10


def test_guided_demonstrations_of_a_knowledge_family_teach_no_level():
    """kin's levels differ in knowledge: a guided demonstration about a level's name would teach the very
    definition an intervention is meant to reveal, so its guided demonstrations ask about nonce names (level 0)
    with complete guidance; lookup's guided demonstrations still come from every guided level."""
    from rail.config import build_config
    from rail.policy_setup import demonstration_batches

    envs = {f: make_env(f, 0) for f in ("lookup", "kin")}
    r = ChatRenderer(build_word_tokenizer(vocabulary(envs)))
    cfg = build_config("default", sets=[{"env": {"families": ["lookup", "kin"]}},
                                        {"warmstart": {"steps": 6, "guided_share": 1.0}}])
    levels = {"lookup": set(), "kin": set()}
    for batch in demonstration_batches(r, envs, cfg):
        for tr in batch:
            levels[tr.family].add(tr.level)
            assert tr.reward == 1.0
            if tr.family == "kin":  # the guidance comes before the first call, so no call is a guess
                context = r.decode(tr.prompt_ids).split("which entity is it ?")[-1]
                assert context.count("then") == 2 or context.count("lookup") == 3, context
    assert levels["kin"] == {0}
    assert levels["lookup"] == {1, 2, 3, 4}


def _rekeyed(seed: int = 0):
    """experiments/my_env.py's cipher under another substitution of the same letters: every word it reads or
    writes is cipher's, but decode's results, and so the answer's argument, differ."""
    env = family_class(CIPHER)(seed)
    env.plain = {c: env.plain[env.letters[(i + 1) % len(env.letters)]] for i, c in enumerate(env.letters)}
    return env


def _key(envs, cfg) -> str:
    from rail.policy_setup import warmstart_cache

    return warmstart_cache(cfg, envs).name


def test_cache_key_follows_what_the_environment_demonstrates_not_only_its_words():
    """The warm-start cache key changes when an environment's behaviour does and its vocabulary does not (a stale
    warm start would imitate calls that now fail), and is the same for the same environment built again, in
    this process and in another one with another hash seed (nothing in it hangs on id(), hash() or set order)."""
    from rail.config import build_config

    cfg = build_config("default", sets=[{"env": {"families": [CIPHER]}}])
    plain, rekeyed = {CIPHER: make_env(CIPHER, 0)}, {CIPHER: _rekeyed(0)}
    assert vocabulary(plain) == vocabulary(rekeyed)
    assert plain[CIPHER].plain != rekeyed[CIPHER].plain
    key = _key(plain, cfg)
    assert _key({CIPHER: make_env(CIPHER, 0)}, cfg) == key == _key(plain, cfg)
    assert _key(rekeyed, cfg) != key
    code = ("from rail.config import build_config; from rail.envs import make_envs; "
            "from rail.policy_setup import warmstart_cache; "
            f"cfg = build_config('default', sets=[{{'env': {{'families': ['{CIPHER}']}}}}]); "
            "print(warmstart_cache(cfg, make_envs(cfg.env.families, cfg.env.seed, cfg.env.options)).name)")
    other_seed = "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"  # this process's is random or set
    out = run([sys.executable, "-c", code], timeout=300, env=child_env(PYTHONHASHSEED=other_seed))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == key


def test_the_warm_start_trains_on_until_its_check_passes(tmp_path, monkeypatch):
    """warmstart.target: below it after warmstart.steps, training goes on in cycles of steps // 2 (each on the
    next demonstrations of the same stream) until the check passes; the check is in the policy's info and the
    cache, and a cached warm start is not checked again."""
    from rail import policy_setup as ps
    from rail.config import build_config

    cfg = build_config("smoke", sets=[{"warmstart": {"target": 0.5, "max_steps": 60, "cache_dir": str(tmp_path)},
                                       "env": {"families": ["lookup"]}}])
    seen = iter([0.1, 0.3, 0.55])
    calls = []
    monkeypatch.setattr(ps, "warm_start_success", lambda model, r, envs, c: calls.append(1) or next(seen))
    envs = {"lookup": make_env("lookup", 0)}
    updates = []
    model, tok, info = ps.make_policy(cfg, envs, progress=lambda i, loss: updates.append(i))
    assert info["warmstart_check"] == {"updates": 40, "success": 0.55, "target": 0.5, "met": True}
    assert updates == list(range(40)) and len(calls) == 3  # 20, then two cycles of 10
    _, _, again = ps.make_policy(cfg, envs)
    assert again["warmstart"].startswith("cached") and again["warmstart_check"]["updates"] == 40 and len(calls) == 3


def test_a_warm_start_that_misses_its_target_stops_the_run(tmp_path, monkeypatch):
    """Below warmstart.target at warmstart.max_steps: a RunError naming the success, the target and the fixes,
    remembered in the cache so another run of the same config stops at once, without training again."""
    from rail import policy_setup as ps
    from rail.config import build_config
    from rail.rundir import RunError

    cfg = build_config("smoke", sets=[{"warmstart": {"target": 0.9, "max_steps": 30, "cache_dir": str(tmp_path)},
                                       "env": {"families": ["lookup"]}}])
    monkeypatch.setattr(ps, "warm_start_success", lambda model, r, envs, c: 0.2)
    envs = {"lookup": make_env("lookup", 0)}
    with pytest.raises(RunError, match=r"reached 0\.200 after 30 updates, below warmstart\.target = 0\.9") as e:
        ps.make_policy(cfg, envs)
    assert "warmstart.max_steps" in str(e.value) and "run.seed" in str(e.value)
    monkeypatch.setattr(ps, "warm_start", lambda *a, **k: pytest.fail("trained again"))
    with pytest.raises(RunError, match="reached 0.200"):
        ps.make_policy(cfg, envs)


def test_the_warm_start_check_measures_held_out_success(monkeypatch):
    """The check itself (no stand-in): warmstart.check_tasks held-out tasks of each family and warm-start level,
    sampled as evaluation samples; an untrained model, which never answers, scores 0."""
    from policy.engine import TransformersEngine
    from rail import policy_setup as ps
    from rail.config import build_config

    cfg = build_config("smoke", sets=[{"warmstart": {"check_tasks": 3, "levels": [1, 2], "enabled": False},
                                       "env": {"families": ["lookup", "kin"]}}])
    envs = {f: make_env(f, 0) for f in ("lookup", "kin")}
    model, tok, _ = ps.make_policy(cfg, envs)
    asked = []
    real = TransformersEngine.generate
    monkeypatch.setattr(TransformersEngine, "generate",
                        lambda self, reqs, params, seed: asked.append((reqs, params)) or real(self, reqs, params, seed))
    assert ps.warm_start_success(model, ChatRenderer(tok), envs, cfg) == 0.0
    (reqs, params), = asked
    held_out = [t.id for f in ("lookup", "kin") for lv in (1, 2) for t in envs[f].eval_tasks(lv, 3)]
    assert sorted(r.task.id for r in reqs) == sorted(held_out) and params.temperature == cfg.eval.temperature
