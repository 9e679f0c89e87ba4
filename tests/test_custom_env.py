"""Environments from outside the package: import paths and options, the protocol's stateful and multi-user-turn
parts, named calls parsed without evaluation, and a smoke run on experiments/my_env.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from processes import rail
from policy.engine import RolloutRequest, SamplingParams, TransformersEngine
from policy.model import build_tiny_model
from policy.records import Guidance, Origin
from policy.tokenizer import ChatRenderer, build_word_tokenizer
from rail.config import ConfigError, build_config, parse_set
from rail.envs import Action, RubricItem, Task, ToolRunner, check_family, make_env, rubric_status
from rail.envs.toolcalls import check_arguments, function_schema, get_format, parse_python_call

ROOT = Path(__file__).resolve().parents[1]
CIPHER = "experiments.my_env:CipherEnv"


def cli(*args, timeout=300):
    return rail(*args, timeout=timeout)


# ---------------------------------------------------------------------------- import paths and options
@pytest.mark.parametrize("entry, needle", [
    ("no_such_pkg.mod:Env", "cannot import module 'no_such_pkg.mod'"),
    ("experiments.my_env:NoSuchEnv", "has no attribute 'NoSuchEnv'"),
    ("rail.envs.base:Step", "lacks system_prompt, tools, sample_tasks, eval_tasks, reward, execute or start"),
    ("rail.envs.base:MESSAGE", "not an environment class"),
    ("chess", "unknown environment 'chess'"),
])
def test_a_bad_entry_is_refused_at_config_time_naming_it(entry, needle):
    with pytest.raises(ConfigError) as e:
        build_config("smoke", sets=[{"env": {"families": [entry]}}])
    msg = str(e.value)
    assert "\n" not in msg and needle in msg and "env.families" in msg


def test_a_bad_import_path_leaves_no_output_directory(tmp_path):
    out = tmp_path / "run"
    r = cli("train", "--preset", "smoke", "--set", "env.families=['experiments.my_env:Nope']", "--out", str(out),
            "--tracking-uri", "")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "experiments.my_env:Nope" in lines[0] and "no attribute 'Nope'" in lines[0]
    assert not out.exists()


def test_options_reach_the_constructor_and_bad_ones_are_refused():
    cfg = build_config("smoke", sets=[parse_set(f"env.families=['{CIPHER}']"),
                                      {"env": {"options": {CIPHER: {"alphabet": 6}}}}])
    env = make_env(CIPHER, 0, cfg.env.options[CIPHER])
    assert len(env.letters) == 6
    with pytest.raises(ConfigError, match=r"env\.families: .*CipherEnv.*unexpected keyword argument 'colour'"):
        build_config("smoke", sets=[{"env": {"families": [CIPHER], "options": {CIPHER: {"colour": 1}}}}])
    with pytest.raises(ConfigError, match=r"env\.options\.kin: 'kin' is not in env\.families"):
        build_config("smoke", sets=[parse_set("env.families=['lookup']"), parse_set("env.options.kin.x=1")])


def test_dotted_set_writes_into_the_options_table():
    cfg = build_config("smoke", sets=[parse_set("env.families=['lookup', 'calc']"),
                                      parse_set("env.options.lookup.n_entities=30")])
    assert cfg.env.options == {"lookup": {"n_entities": 30}}
    assert len(make_env("lookup", 0, cfg.env.options["lookup"]).entities) == 30
    with pytest.raises(ConfigError, match="env.options"):
        build_config("smoke", sets=[parse_set("env.options=3")])


def test_an_environment_without_a_vocabulary_needs_a_checkpoint(tmp_path):
    class NoVocab:  # everything but vocabulary()
        levels = (1,)

        def __init__(self, seed=0):
            pass

        system_prompt = tools = sample_tasks = eval_tasks = reward = execute = item_holds = lambda *a: None

    sys.modules["_rail_test_novocab"] = type(sys)("_rail_test_novocab")
    sys.modules["_rail_test_novocab"].NoVocab = NoVocab
    assert check_family("_rail_test_novocab:NoVocab") is NoVocab
    with pytest.raises(ConfigError, match="no closed vocabulary.*model.path"):
        build_config("smoke", sets=[{"env": {"families": ["_rail_test_novocab:NoVocab"]}}])
    with pytest.raises(ConfigError, match="model.path = 'x': not a Hugging Face model directory"):
        build_config("smoke", sets=[{"env": {"families": ["_rail_test_novocab:NoVocab"]}, "model": {"path": "x"}}])
    (tmp_path / "config.json").write_text("{}")  # a model directory; validation loads nothing
    build_config("smoke", sets=[{"env": {"families": ["_rail_test_novocab:NoVocab"]}, "model": {"path": str(tmp_path)}}])


# ---------------------------------------------------------------------------- named calls, never evaluated
SCHEMAS = [function_schema("cd", "change directory", [("folder", "string", "a folder")]),
           {"type": "function", "function": {"name": "sort", "description": "", "parameters": {
               "type": "object", "properties": {"file_name": {"type": "string"}, "reverse": {"type": "boolean"},
                                                "keys": {"type": "array", "items": {"type": "integer"}}},
               "required": ["file_name"]}}}]


def test_python_calls_are_parsed_from_literals_only(tmp_path):
    marker = tmp_path / "pwned"
    assert parse_python_call("cd(folder='docs')", SCHEMAS) == Action.named("cd", {"folder": "docs"})
    assert parse_python_call("[sort('a.txt', reverse=True)]", SCHEMAS) == \
        Action.named("sort", {"file_name": "a.txt", "reverse": True})
    for text in [f"cd(folder=__import__('os').system('touch {marker}'))",
                 f"__import__('os').system('touch {marker}')",
                 f"cd(folder=open('{marker}', 'w'))", "cd(folder=1 + 2)", "cd(**{'folder': 'x'})",
                 "cd(folder='a', folder='b')", "cd(folder='a'); cd(folder='b')", "cd(folder={1, 2})",
                 "cd('a', 'b')", "os.cd(folder='a')", "cd(folder=float('nan'))"]:
        assert parse_python_call(text, SCHEMAS) is None, text
    assert not marker.exists()


def test_named_calls_round_trip_through_every_format_and_are_checked_against_the_schema():
    action = Action.named("sort", {"file_name": "it's, (odd).txt", "reverse": False, "keys": [3, 1]})
    for fmt in ("builtin", "hermes", "json"):
        f = get_format(fmt)
        assert f.parse(f.render(action, SCHEMAS), SCHEMAS, named=True) == action, fmt
    assert action.render() == "sort(file_name=\"it's, (odd).txt\", keys=[3, 1], reverse=False)"
    # named parsing accepts any tool and leaves the schema to the environment, which says what is wrong
    hermes = get_format("hermes")
    assert hermes.parse('<tool_call>{"name": "rm", "arguments": {"x": 1}}</tool_call>', SCHEMAS, named=True) == \
        Action.named("rm", {"x": 1})
    assert hermes.parse('<tool_call>{"name": "cd", "arguments": [1]}</tool_call>', SCHEMAS, named=True) is None
    sort = SCHEMAS[1]
    assert check_arguments({"file_name": "a"}, sort) is None
    assert "missing required argument(s) file_name" in check_arguments({}, sort)
    assert "unexpected argument(s) depth" in check_arguments({"file_name": "a", "depth": 2}, sort)
    assert "argument keys must be of type array" in check_arguments({"file_name": "a", "keys": [1, "x"]}, sort)
    assert "argument reverse must be of type boolean" in check_arguments({"file_name": "a", "reverse": 1}, sort)


# ---------------------------------------------------------------------------- stateful, several user turns
class Tally:
    """A stateful environment of two user turns: each asks for one ``inc()``; the state is a counter."""

    name, levels, named_arguments = "tally", (1,), True
    TASK = Task("tally:0", "tally", 1, "add one", "", (
        RubricItem("turn 1", "turn", Action.named("inc", {}), guide_end=2),
        RubricItem("turn 2", "turn", Action.named("inc", {}), guide_end=4)),
        (Action.named("inc", {}), Action.message("ok"), Action.named("inc", {}), Action.message("ok")))

    class Episode:
        def __init__(self):
            self.count, self.turn, self.log = 0, 0, []

        def execute(self, action):
            if action is None or action.tool == "":
                self.log.append(self.count)
                self.turn += 1
                return ("", True, True) if self.turn == 2 else ("", True, False, "add one more")
            self.count += 1
            return str(self.count), True, False

    def system_prompt(self): return "count"
    def tools(self): return [function_schema("inc", "add one", [])]
    def vocabulary(self): return ["count", "add", "one", "more", "ok", "inc", "(", ")", "1", "2", "3", "4"]
    def sample_tasks(self, rng, levels, n): return [self.TASK] * n
    def eval_tasks(self, level, n): return [self.TASK][:n]
    def start(self, task): return self.Episode()

    def _replay(self, steps):
        ep = self.start(self.TASK)
        for st in steps:
            ep.execute(st.action)
        return ep.log

    def reward(self, task, steps): return 1.0 if self._replay(steps) == [1, 2] else 0.0

    def rubric_achieved(self, task, steps):
        log, closes = self._replay(steps), [i for i, st in enumerate(steps) if st.action is None or st.action.tool == ""]
        return [closes[k] if k < len(log) and log[k] == k + 1 else None for k in range(2)]


def test_a_stateful_episode_hands_over_to_the_next_user_message():
    env, task = Tally(), Tally.TASK
    runner = ToolRunner(env).begin(task)
    steps = [runner.step(task, t) for t in ("inc()", "all done", "inc()", "ok")]
    assert [s.observation for s in steps] == ["1", "", "2", ""]
    assert steps[1].user == "add one more" and not steps[1].done and steps[3].done
    assert env.reward(task, steps) == 1.0
    st = rubric_status(env, task, steps[:2])
    assert st.holds == (True, False) and st.first_violated == 1 and st.violated_turn == 2
    fresh = ToolRunner(env).begin(task, steps[:1])  # a branch continues from the prefix's state
    assert fresh.step(task, "inc()").observation == "2"


def test_engine_opens_one_episode_per_rollout_and_renders_the_next_user_message():
    env = Tally()
    tok = build_word_tokenizer(env.vocabulary())
    model = build_tiny_model(len(tok), hidden_size=16, layers=1, heads=2, kv_heads=1, intermediate_size=32,
                             max_positions=256, seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    r = ChatRenderer(tok)
    runner = ToolRunner(env)
    reqs = [RolloutRequest(task=Tally.TASK, env=runner, system="count", guidance=Guidance(inject="inc ( )"))
            for _ in range(3)]
    trajs = TransformersEngine(model, r).generate(reqs, SamplingParams(max_tokens_per_turn=4, max_turns=4), seed=0)
    for tr in trajs:
        assert tr.steps[0].observation == "1"  # each rollout counts on its own state
        closes = [k for k, s in enumerate(tr.steps) if s.user is not None]
        if closes:  # the next user message follows that turn as a user message, untrained
            k = closes[0]
            glue = [t for t, o, turn in zip(tr.ids, tr.origin, tr.turn) if turn == k and o == Origin.TOOL]
            suffix = r.tool_suffix("", "add one more")
            assert glue[-len(suffix):] == suffix
            assert tok.decode(suffix, skip_special_tokens=True).split() == ["user", "add", "one", "more", "assistant"]
    assert any(s.user is not None for tr in trajs for s in tr.steps)
    ids, a, b = r.tool_suffix_with_hint("", "add one", "add one more")  # a hint after the next user message
    assert ids[:a] + ids[b:] == r.tool_suffix("", "add one more")
    assert tok.decode(ids[a:b], skip_special_tokens=True).split() == ["user", "add", "one"]


# ---------------------------------------------------------------------------- an environment from outside
def test_cipher_example_is_a_complete_environment():
    env = make_env(CIPHER, 0)
    task = env.sample_tasks(np.random.default_rng(0), [3], 1)[0]
    runner = ToolRunner(env)
    steps = [runner.step(task, a.render()) for a in task.action_guide]
    assert env.reward(task, steps) == 1.0 and rubric_status(env, task, steps).progress == 1.0
    held = env.eval_tasks(2, 10)
    assert held == env.eval_tasks(2, 10) and len({t.id for t in held}) == 10
    train = {t.id for t in env.sample_tasks(np.random.default_rng(1), [2], 300)}
    assert not train & {t.id for t in env.eval_tasks(2, 200)}


def test_smoke_run_trains_on_an_environment_named_by_import_path(tmp_path):
    out = tmp_path / "run"
    r = cli("train", "--preset", "smoke", "--set", f"env.families=['lookup', '{CIPHER}']",
            "--set", f'env.options={{"{CIPHER}" = {{alphabet = 8}}}}', "--set", f"warmstart.cache_dir='{tmp_path}'",
            "--out", str(out), "--tracking-uri", "", "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["eval"]["final"]) == {"lookup", "cipher"}
    assert summary["steps"] == 3 and summary["tool_calls"]["calls"] > 0
    families = {json.loads(ln)["c"]["s"]["family"] for ln in (out / "traces" / "decisions.dsjson").read_text().splitlines()}
    assert CIPHER in families
    assert "cipher" in r.stdout


def test_vault_held_out_environment_is_complete_and_out_of_unguided_reach():
    """experiments/vault_env.py, the claim's held-out check: the guide solves a task, a guess almost never does,
    the hint states the code, and training never draws a held-out task."""
    env = make_env("experiments.vault_env:VaultEnv", 3)
    check_family("experiments.vault_env:VaultEnv")
    task = env.sample_tasks(np.random.default_rng(0), [3], 1)[0]
    runner = ToolRunner(env)
    steps = [runner.step(task, a.render()) for a in task.action_guide]
    assert env.reward(task, steps) == 1.0 and rubric_status(env, task, steps).progress == 1.0
    code = env.codes[task.answer]
    assert task.rubric[0].evidence == f"the {task.answer} code is " + " then ".join(code)
    rng = np.random.default_rng(1)
    guesses = [env.reward(task, [runner.step(task, Action("press", (str(b),)).render())
                                 for b in rng.choice(["red", "blue", "green", "amber", "white", "black"], 3)]
                          + [runner.step(task, Action("open", (task.answer,)).render())]) for _ in range(600)]
    assert 0 < sum(guesses) < 12  # one code in 216
    wrong = [*steps[:3], runner.step(task, Action("open", ("attic" if task.answer != "attic" else "cellar",)).render())]
    assert env.reward(task, wrong) == 0.0
    held = env.eval_tasks(3, 48)
    assert len(held) == 48 and held == env.eval_tasks(3, 48)
    assert not {t.id for t in env.sample_tasks(np.random.default_rng(2), [3], 500)} & {t.id for t in held}
    assert set(" ".join([task.prompt, task.rubric[0].evidence, env.system_prompt()]).split()) <= set(env.vocabulary())
    # guided demonstrations: training tasks by default, nonce vaults with a fresh code with the option
    assert env.demonstration_task(np.random.default_rng(4), [3], True).answer in env.codes
    nonce = make_env("experiments.vault_env:VaultEnv", 3, {"nonce_demonstrations": True})
    demos = [nonce.demonstration_task(np.random.default_rng(i), [3, 4], True) for i in range(20)]
    assert all(d.answer not in nonce.codes and d.level == 0 for d in demos)
    assert len({d.rubric[0].evidence for d in demos}) > 10  # codes drawn afresh
    steps = [runner.step(demos[0], a.render()) for a in demos[0].action_guide]
    assert nonce.reward(demos[0], steps) == 1.0
    assert set(demos[0].prompt.split()) <= set(nonce.vocabulary())
    assert nonce.demonstration_task(np.random.default_rng(4), [1, 2], False).level in (1, 2)
