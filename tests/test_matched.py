"""Guidance rules at matched FLOPs (train/bench/matched.py): the step search and the best-scale comparison."""

import pytest

from train.bench import matched


@pytest.mark.parametrize("per_step, fixed, budget, start", [(10, 5, 245, 12), (10, 5, 244, 12), (7, 0, 1000, 12),
                                                            (10, 0, 3, 12), (1, 0, 100, 1)])
def test_matched_steps_is_the_most_steps_within_the_budget(per_step, fixed, budget, start):
    calls = []

    def flops_at(steps):
        calls.append(steps)
        return per_step * steps + fixed

    steps = matched.matched_steps(flops_at, budget, start)
    within = [n for n in range(1, 1000) if per_step * n + fixed <= budget]
    assert steps == (max(within) if within else 1)  # never below one step, even when one step is over budget
    assert len(calls) < 40  # a search, not a scan


def test_best_rules_and_their_paired_difference_from_cfg():
    def row(run, rule, kind, fd, acc):
        return {"group": "edm dit-sprint", "run": run, "rule": rule, "kind": kind, "classifier_fd": fd, "class_accuracy": acc,
                "gflops_per_image": 1.0 if kind == "cfg" else 0.9}

    rows = [row(run, rule, kind, fd + shift, acc) for run, shift in (("s0", 0.0), ("s1", 2.0), ("s2", 1.0))
            for rule, kind, fd, acc in (("CFG 1.5", "cfg", 30, 0.5), ("CFG 2", "cfg", 20, 0.6),
                                        ("PDG 2", "pdg", 25, 0.55), ("PDG 3", "pdg", 10, 0.7), ("plain", "plain", 50, 0.3))]
    agg = [{**row("", rule, kind, sum(r["classifier_fd"] for r in rows if r["rule"] == rule) / 3, 0.0), "classifier_fd_ci95": None}
           for rule, kind in (("CFG 1.5", "cfg"), ("CFG 2", "cfg"), ("PDG 2", "pdg"), ("PDG 3", "pdg"), ("plain", "plain"))]
    # A scale swept on one of the three runs only (a pooled study) does not compete, however low its mean.
    agg = [{**a, "runs": 3} for a in agg] + [{**row("", "PDG 5", "pdg", 1, 0.0), "classifier_fd_ci95": None, "runs": 1}]
    best = matched.best_per_kind(agg)
    assert [b["rule"] for b in best] == ["CFG 2", "PDG 3"]  # plain is not a guidance kind
    (versus,) = matched.against_cfg(rows, best)
    assert (versus["rule"], versus["cfg_rule"], versus["runs"]) == ("PDG 3", "CFG 2", 3)
    # The same -10 FD on every run: a paired interval of width 0, so PDG wins; accuracy +0.1 on every run wins too.
    assert versus["classifier_fd"]["diff"] == pytest.approx(-10) and versus["classifier_fd"]["verdict"] == "wins"
    assert versus["class_accuracy"]["diff"] == pytest.approx(0.1) and versus["class_accuracy"]["verdict"] == "wins"
    assert "| edm dit-sprint | PDG 3 | CFG 2 | 3 |" in "\n".join(matched.markdown(best, [versus]))
