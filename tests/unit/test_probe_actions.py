# SPDX-License-Identifier: Apache-2.0
"""Probe actions without an engine: the request form's checks, and the
engine's decision over a step's scores (``engine/probe_actions.py``)."""

import msgspec
import numpy as np
import pytest

from vllm_hidden_states.contract import Intervention, ProbeAction, SteerGate
from vllm_hidden_states.engine.probe_actions import _evaluate, _Watched
from vllm_hidden_states.probe_actions import action_probes, check_monitors, check_probe_actions

PROBES = {"harm": {"k": 1}, "topic": {"k": 3}}


def test_an_action_is_checked_into_its_struct_with_defaults():
    (action,) = check_probe_actions([{"probe": "harm", "above": 0.5}], PROBES)
    assert action == ProbeAction(label="harm", probe="harm", threshold=0.5)
    assert (action.above, action.column, action.consecutive, action.then) == (True, 0, 1, "stop")


def test_below_for_and_output_are_read():
    (action,) = check_probe_actions(
        [{"probe": "topic", "below": -1, "for": 3, "output": 2, "then": "flag"}], PROBES
    )
    assert (action.above, action.threshold, action.consecutive, action.column, action.then) == (
        False,
        -1.0,
        3,
        2,
        "flag",
    )


@pytest.mark.parametrize(
    "item, says",
    [
        ({"probe": "harm", "above": float("nan")}, "must be finite"),
        ({"probe": "harm", "above": True}, "must be a number"),
        ({"probe": "harm"}, "exactly one of 'above' and 'below'"),
        ({"probe": "topic", "above": 0}, r"has 3 outputs; 'output' must be an integer in 0..2"),
        ({"probe": "harm", "above": 0, "output": 1}, "in 0..0"),
        ({"probe": "harm", "above": 0, "for": 1.5}, "'for' must be an integer >= 1"),
        ({"probe": "harm", "above": 0, "when": 1}, r"unknown keys \['when'\]"),
        ({"probe": "nope", "above": 0}, "probe 'nope' is not loaded"),
        ("harm", "must be an object"),
    ],
)
def test_a_bad_action_says_what_was_wrong_and_what_is_allowed(item, says):
    with pytest.raises(ValueError, match=says):
        check_probe_actions([item], PROBES)


STEER = [{"point": "resid_pre.1", "op": "add", "name": "calm", "strength": 2}]


def test_a_steer_action_keeps_its_interventions_for_the_front_end():
    (action,) = check_probe_actions(
        [{"probe": "harm", "above": 0.5, "then": {"steer": STEER}}], PROBES
    )
    assert (action.then, action.steer) == ("steer", STEER)


@pytest.mark.parametrize(
    "then, says",
    [
        ({"steer": []}, "'then.steer' must be a non-empty list of interventions"),
        ({"steer": STEER, "stop": 1}, r'"stop", "flag" or \{"steer"'),
        ({"steer": ["x"]}, r"then.steer\[0\] must be an object"),
        (
            {"steer": [{**STEER[0], "positions": "all"}]},
            r"'positions' is not allowed in a steer action: its interventions apply "
            "from the generated position after the firing one",
        ),
        (
            {"steer": [{**STEER[0], "op": "ablate"}]},
            r"op 'ablate' cannot be turned on by a probe action; allowed: \['add'\]",
        ),
        ("explode", r'\'then\' must be "stop", "flag" or \{"steer"'),
    ],
)
def test_a_bad_steer_action_says_what_is_allowed(then, says):
    with pytest.raises(ValueError, match=says):
        check_probe_actions([{"probe": "harm", "above": 0, "then": then}], PROBES)


def test_a_monitor_cannot_steer():
    with pytest.raises(ValueError, match="a steer action is a request's own"):
        check_monitors(
            [{"name": "m", "probe": "harm", "above": 0, "then": {"steer": STEER}}], PROBES
        )


def test_an_engine_without_probes_says_how_to_load_them():
    with pytest.raises(ValueError, match="--probes DIR"):
        check_probe_actions([{"probe": "harm", "above": 0}], {})


def test_the_probes_scored_are_those_asked_then_those_only_actions_read():
    actions = check_probe_actions(
        [{"probe": "topic", "above": 0, "output": 0}, {"probe": "harm", "above": 0}], PROBES
    )
    assert action_probes(actions, ("harm",)) == ("harm", "topic")


def watched(*actions: ProbeAction, position: int = 10) -> _Watched:
    return _Watched(list(actions), [0] * len(actions), position, [0] * len(actions))


def test_a_stop_fires_at_the_first_row_above_and_ends_the_evaluation():
    w = watched(ProbeAction(label="harm", probe="harm", threshold=0.5))
    firings = _evaluate(w, np.array([[0.1], [0.7], [0.9]], np.float32))
    assert [(f.position, f.then) for f in firings] == [(11, "stop")]
    assert firings[0].score == pytest.approx(0.7)


def test_a_run_of_consecutive_rows_carries_over_steps():
    w = watched(ProbeAction(label="h", probe="h", threshold=0.0, above=False, consecutive=3))
    assert _evaluate(w, np.array([[-1.0], [-1.0]], np.float32)) == []
    (firing,) = _evaluate(w, np.array([[-2.0]], np.float32))
    assert firing.position == 12


def test_a_flag_reports_every_row_where_it_holds_and_a_stop_beside_it_ends_them():
    flag = ProbeAction(label="f", probe="h", threshold=0.0, then="flag")
    stop = ProbeAction(label="s", probe="h", threshold=0.8)
    w = watched(flag, stop, position=0)
    firings = _evaluate(w, np.array([[0.5], [-1.0], [0.9], [0.95]], np.float32))
    assert [(f.label, f.position) for f in firings] == [("f", 0), ("f", 2), ("s", 2)]


def test_a_steer_action_is_reported_once_at_its_first_firing():
    steer = ProbeAction(label="s", probe="h", threshold=0.5, then="steer", steer=STEER)
    w = watched(steer, position=0)
    (firing,) = _evaluate(w, np.array([[0.1], [0.7], [0.9]], np.float32))
    assert (firing.position, firing.then) == (1, "steer")
    assert _evaluate(w, np.array([[0.8]], np.float32)) == []
    assert w.new_steers == [(0, 1)]


def test_a_fired_steer_action_turns_its_gated_entries_plain_from_the_next_position():
    from vllm_hidden_states.probe_actions import steered_from

    plain = Intervention(point="resid_pre.3", id=3, op="add", start=0)
    gated = [
        Intervention(
            point="resid_pre.5", id=5, op="add", start=7, gate=SteerGate(g, 0, 0.5, True, 1)
        )
        for g in (0, 1)
    ]
    out = steered_from([plain, *gated], {0: 9})
    assert out == [plain, msgspec.structs.replace(gated[0], gate=None, start=10), gated[1]]
    # A firing in the prompt: from the entry's own start, the first generated position.
    assert steered_from(gated[:1], {0: 2})[0].start == 7


def test_a_steer_firing_is_matched_to_its_action_by_label_and_condition():
    from vllm_hidden_states.contract import ProbeFiring
    from vllm_hidden_states.probe_actions import steer_action_of

    actions = [
        ProbeAction(label="h", probe="h", threshold=0.5, then="flag"),
        ProbeAction(label="h", probe="h", threshold=0.9, then="steer", steer=STEER),
        ProbeAction(label="h", probe="h", threshold=0.2, then="steer", steer=STEER),
    ]
    firing = ProbeFiring(label="h", position=4, score=0.3, then="steer")
    assert steer_action_of(actions, firing, set()) == 2
    assert steer_action_of(actions, firing, {2}) is None


# -- the worker's device gate (worker/probe_gates.py), on CPU tensors ------------


def gate_of(threshold: float, above: bool, run: int, column: int = 0):
    import torch

    from vllm_hidden_states.worker.probe_gates import RequestGates

    gates = RequestGates([0], [SteerGate(0, column, threshold, above, run)], torch.device("cpu"))
    gates.slots = torch.tensor([1])
    return gates


def test_the_gate_fires_on_the_first_run_long_enough_across_steps():
    import torch

    gates = gate_of(0.0, above=False, run=3, column=1)
    gates.update(torch.tensor([[9.0, -1.0], [9.0, 1.0], [9.0, -1.0]]), first=20)
    gates.update(torch.tensor([[9.0, -2.0]]), first=23)
    assert not bool(gates.fired[0])  # a run of 2 so far
    gates.update(torch.tensor([[9.0, -2.0], [9.0, 5.0]]), first=24)
    assert bool(gates.fired[0]) and int(gates.runs[0]) == 0
    assert int(gates.fired_at[0]) == 24  # where the run reached 3


def test_a_fired_gate_keeps_its_first_firing_position():
    import torch

    gates = gate_of(0.5, above=True, run=1)
    gates.update(torch.tensor([[0.2], [0.7], [0.9]]), first=10)
    gates.update(torch.tensor([[0.8]]), first=13)
    assert int(gates.fired_at[0]) == 11


def test_rebuilt_gates_carry_the_runs_of_their_actions():
    import torch

    from vllm_hidden_states.worker.probe_gates import RequestGates

    earlier = RequestGates(
        [0, 1], [SteerGate(0, 0, 0.5, True, 3), SteerGate(2, 0, 0.5, True, 3)], torch.device("cpu")
    )
    earlier.update(torch.tensor([[0.9], [0.9]]), first=5)  # runs of 2, unfired
    rebuilt = RequestGates([0], [SteerGate(2, 0, 0.5, True, 3)], torch.device("cpu"))
    rebuilt.carry_runs(earlier)
    assert rebuilt.runs.tolist() == [2]


def test_the_gated_row_holds_zero_until_fired_then_the_vector():
    import torch

    gates = gate_of(0.5, above=True, run=1)
    adds, armed = torch.zeros(3, 4), torch.zeros(3, 4)
    armed[1] = torch.arange(4.0)
    gates.update(torch.tensor([[0.2]]), first=4)
    gates.apply(adds, armed)
    assert not adds.any()
    gates.update(torch.tensor([[0.2], [0.6], [0.1]]), first=5)
    gates.apply(adds, armed)
    assert torch.equal(adds[1], armed[1]) and not adds[0].any() and not adds[2].any()


# -- server monitors (--monitors FILE) ------------------------------------------


@pytest.fixture
def probes_dir(tmp_path):
    from vllm_hidden_states.probes import save_probe

    directory = tmp_path / "probes"
    save_probe(directory / "harm.safetensors", np.ones(8), [0.0], "-1")
    return directory


def load(tmp_path, probes_dir, text: str, suffix: str = ".yaml"):
    from types import SimpleNamespace

    from vllm_hidden_states.server import monitors

    path = tmp_path / f"monitors{suffix}"
    path.write_text(text)
    monitors.load_monitors(SimpleNamespace(monitors=str(path), probes=str(probes_dir)))
    return monitors


def test_a_monitors_file_puts_its_monitors_on_every_request(tmp_path, probes_dir):
    from types import SimpleNamespace

    monitors = load(tmp_path, probes_dir, "- {name: harm-stop, probe: harm, above: 0.5}\n")
    params = SimpleNamespace(extra_args={"probe_monitors": [], "other": 1})
    monitors.put_monitors(params)
    assert params.extra_args == {
        "other": 1,
        "probe_monitors": [{"name": "harm-stop", "probe": "harm", "above": 0.5}],
    }
    monitors.load_monitors(SimpleNamespace(monitors=None, probes=None))
    monitors.put_monitors(params)  # none on this server: a client's are taken away
    assert params.extra_args == {"other": 1}


@pytest.mark.parametrize(
    "text, suffix, says",
    [
        ("[{name: x, probe: harm, above: 0.5", ".yaml", "not valid .yaml"),
        ('[{"name": "x", "probe": "nope", "above": 0.5}]', ".json", "probe 'nope' is not loaded"),
        ('[{"probe": "harm", "above": 0.5}]', ".json", "'name' must be a plain name"),
        (
            '[{"name": "a", "probe": "harm", "above": 1}, {"name": "a", "probe": "harm", '
            '"below": 0}]',
            ".json",
            "names must be distinct",
        ),
        ('{"monitors": []}', ".json", "non-empty list of named actions"),
    ],
)
def test_a_monitors_file_that_does_not_load_names_the_file_and_why(
    tmp_path, probes_dir, text, suffix, says
):
    with pytest.raises(ValueError, match=f"--monitors .*monitors{suffix}: .*{says}"):
        load(tmp_path, probes_dir, text, suffix)


def test_monitors_need_probes_on_the_server(tmp_path):
    from types import SimpleNamespace

    from vllm_hidden_states.server.monitors import load_monitors

    with pytest.raises(ValueError, match="start the server with --probes DIR too"):
        load_monitors(SimpleNamespace(monitors=str(tmp_path / "m.json"), probes=None))


def watch_of(**actions_of: list[ProbeAction]):
    """An :class:`ActionWatch` with one request per keyword (its id), each
    scoring one probe ``h`` (k=1) from position 10."""
    from types import SimpleNamespace

    from vllm_hidden_states.contract import HiddenStatesSpec
    from vllm_hidden_states.engine.probe_actions import ActionWatch

    watch = ActionWatch()
    for req_id, actions in actions_of.items():
        spec = HiddenStatesSpec(
            layers=[],
            abs_layers=[],
            start=10,
            probes=["h"],
            probe_widths=[1],
            probe_actions=actions,
        )
        watch.add(SimpleNamespace(request_id=req_id, hidden_states_spec=spec))
    return watch


def group(req_ids: list[str], rows: list[list[float]], first: int = 10):
    """One step's group: each request's ``len(rows) // len(req_ids)`` rows
    from position ``first`` on."""
    import torch

    from vllm_hidden_states.contract import CapturedRows

    count = len(rows) // len(req_ids)
    return CapturedRows(
        req_ids=req_ids,
        counts=[count] * len(req_ids),
        firsts=[first] * len(req_ids),
        probe_scores=torch.tensor(rows, dtype=torch.float32),
    )


def test_a_step_where_no_condition_holds_ends_every_run():
    slow = ProbeAction(label="slow", probe="h", threshold=0.0, above=False, consecutive=2)
    watch = watch_of(a=[slow], b=[ProbeAction(label="hi", probe="h", threshold=0.9)])
    watch.decide(None, {}, [group(["a", "b"], [[-1.0], [0.5]], first=10)])  # a's run: 1
    assert watch.watched["a"].runs == [1]
    watch.decide(None, {}, [group(["a", "b"], [[0.5], [0.5]], first=11)])  # nothing holds
    watch.decide(None, {}, [group(["a", "b"], [[-1.0], [0.5]], first=12)])  # a's run: 1 again
    assert watch.watched["a"].runs == [1] and watch.watched["a"].position == 13


def test_a_quiet_step_costs_nothing_per_request():
    watch = watch_of(a=[ProbeAction(label="hi", probe="h", threshold=0.9)])
    before = watch.watched["a"]
    watch.decide(None, {}, [group(["a"], [[0.5]], first=10)])
    assert watch.watched["a"] is before and before.position == 10 and before.runs == [0]


def test_a_condition_holding_for_one_request_is_decided_per_request():
    # 0.95 passes b's threshold but not a's: the step is not quiet, and a
    # (its own 0.95 below 0.99) does not fire.
    a = ProbeAction(label="a", probe="h", threshold=0.99, then="flag")
    b = ProbeAction(label="b", probe="h", threshold=0.9, then="flag")
    watch = watch_of(a=[a], b=[b])
    assert not watch._quiet(np.array([[0.95], [0.1]], np.float32))
    evaluated = _evaluate(watch.watched["a"], np.array([[0.95]], np.float32))
    assert evaluated == [] and watch.watched["a"].position == 11


def test_the_conditions_leave_with_their_last_request():
    watch = watch_of(a=[ProbeAction(label="h", probe="h", threshold=0.5)])
    watch.forget("a")
    watch.end_step()
    assert watch._conditions == {} and watch._quiet(np.array([[0.9]], np.float32))
