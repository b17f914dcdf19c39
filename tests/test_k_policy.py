"""Choosing K per step (mtpkern/k_policy.py; docs/api.md, "Choosing the number of drafts per
step"): hand-computed rates, the conditional acceptance counters, monotonicity in acceptance,
the limits (free steps give k_max, a costly propose gives 0), input errors, and a policy that
ignores acceptance failing the same checks."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import rand_hiddens
from mtpkern import AcceptanceStats, StepCosts, acceptance_from_counts, acceptance_from_stats, choose_k
from mtpkern.k_policy import CostTable, expected_tokens


def linear_costs(prop_a, prop_b, ver_c, ver_d, batch_sizes=(1,)):
    """propose(k) = prop_a + prop_b * k, verify(n) = ver_c + ver_d * n at each batch size, as
    two measured points each."""
    return StepCosts.from_points(
        propose=[(B, k, prop_a + prop_b * k) for B in batch_sizes for k in (1, 2)],
        verify=[(B, n, ver_c + ver_d * n) for B in batch_sizes for n in (1, 2)])


# -- hand-computed values ---------------------------------------------------------------------------------

def test_expected_tokens_by_hand():
    assert expected_tokens([0.5, 0.5, 0.5]).tolist() == [1.0, 1.5, 1.75, 1.875]
    assert expected_tokens([1.0, 0.0, 1.0]).tolist() == [1.0, 2.0, 2.0, 2.0]      # nothing past a sure rejection
    assert expected_tokens([]).tolist() == [1.0]                                  # K = 0: the bonus token
    assert expected_tokens([[0.5, 1.0], [0.25, 0.5]]).tolist() == [[1.0, 1.5, 2.0], [1.0, 1.25, 1.375]]


#: propose(k) = k s, verify(n) = 4 s flat; per alphas, the K and the rates of K = 0 .. 3
HAND = [([0.5] * 3, 1, [1 / 4, 1.5 / 5, 1.75 / 6, 1.875 / 7]),
        ([0.9] * 3, 3, [1 / 4, 1.9 / 5, 2.71 / 6, 3.439 / 7]),
        ([0.2] * 3, 0, [1 / 4, 1.2 / 5, 1.24 / 6, 1.248 / 7])]


def _hand_checks(policy):
    """The cases of HAND, through ``policy(alphas, costs, k_max) -> KChoice``."""
    costs = linear_costs(0.0, 1.0, 4.0, 0.0)
    for alphas, k, rates in HAND:
        got = policy(np.array(alphas), costs, 3)
        assert got.k == k, f"alphas {alphas}: K = {got.k}, expected {k}"
        np.testing.assert_allclose(got.tokens_per_second, rates, rtol=1e-12)
        np.testing.assert_allclose(got.step_seconds, [4, 5, 6, 7], rtol=1e-12)


def test_one_sequence_by_hand():
    _hand_checks(choose_k)


def test_a_policy_that_ignores_acceptance_fails_the_hand_checks():
    """Negative control: the same checks, with the acceptance replaced by a constant."""
    def blind(alphas, costs, k_max):
        return choose_k(np.full_like(alphas, 0.5), costs, k_max)

    with pytest.raises(AssertionError, match="K = 1, expected 3"):
        _hand_checks(blind)


def test_a_batch_by_hand_and_ties_go_to_the_smaller_k():
    # B = 2: propose(k) = 0.5 + 0.5 k, verify(n) = 1.5 + 0.5 n -> T = [2, 3.5, 4.5]
    costs = StepCosts.from_points(propose=[(2, 1, 1.0), (2, 2, 1.5)], verify=[(2, 1, 2.0), (2, 3, 3.0)])
    got = choose_k([[1.0, 0.0], [0.5, 0.5]], costs, 2)        # E: [1, 2, 2] + [1, 1.5, 1.75]
    assert got.expected_tokens.tolist() == [2.0, 3.5, 3.75] and got.step_seconds.tolist() == [2.0, 3.5, 4.5]
    assert got.tokens_per_second.tolist() == [1.0, 1.0, 3.75 / 4.5] and got.k == 0   # K = 0 and 1 tie
    more = choose_k([[1.0, 0.0], [0.75, 0.5]], costs, 2)      # E: [2, 3.75, 4.125]: K = 1 wins
    assert more.k == 1 and more.tokens_per_second[1] == pytest.approx(3.75 / 3.5)


def test_a_shared_acceptance_counts_each_sequence():
    costs = linear_costs(0.0, 1.0, 4.0, 0.0, batch_sizes=(1, 4))
    shared = choose_k([0.5, 0.5, 0.5], costs, 3, batch_size=4)
    rows = choose_k(np.tile([0.5, 0.5, 0.5], (4, 1)), costs, 3)
    assert shared.k == rows.k == 1
    assert shared.expected_tokens.tolist() == rows.expected_tokens.tolist() == [4.0, 6.0, 7.0, 7.5]


def test_costs_through_the_points_between_batch_sizes_and_beyond():
    t = CostTable.from_points("verify", [(1, 1, 1.0), (1, 3, 2.0), (1, 5, 6.0), (5, 1, 3.0), (5, 5, 7.0)])
    assert t([1, 2, 3, 4, 5, 7], 1).tolist() == [1.0, 1.5, 2.0, 4.0, 6.0, 10.0]     # past 5: the last segment
    assert t([1, 5], 5).tolist() == [3.0, 7.0]
    assert t([1, 3, 5], 3).tolist() == [2.0, 3.5, 6.5]                             # halfway between B = 1 and 5
    affine = CostTable.from_points("verify", [(1, 1, 1.0), (1, 2, 3.0), (1, 3, 2.0)], fit="affine")
    np.testing.assert_allclose(affine([0, 1, 2, 3], 1), [1.0, 1.5, 2.0, 2.5], rtol=1e-12)   # least squares
    costs = StepCosts.from_points(propose=[(1, 1, 0.5), (1, 3, 1.5)], verify=[(1, 1, 2.0), (1, 4, 2.3)])
    np.testing.assert_allclose(costs.step_seconds(3, 1), [2.0, 2.6, 3.2, 3.8], rtol=1e-12)


# -- acceptance -------------------------------------------------------------------------------------------

def test_acceptance_from_counts_under_the_prior():
    a = acceptance_from_counts([8, 3, 0], [10, 6, 0], 5)
    np.testing.assert_allclose(a, [9 / 12, 4 / 8, 0.5, 0.5, 0.5], rtol=1e-12)     # never offered: the prior's mean
    b = acceptance_from_counts([0, 10], [10, 10], 2, prior=(2.0, 6.0))
    np.testing.assert_allclose(b, [2 / 18, 12 / 18], rtol=1e-12)                  # never 0 or 1
    per_seq = acceptance_from_counts([[1, 0], [2, 2]], [[2, 1], [2, 2]], 1)
    np.testing.assert_allclose(per_seq, [[0.5], [0.75]], rtol=1e-12)
    assert acceptance_from_counts([1.5], [2.5], 1).tolist() == [2.5 / 4.5]         # decayed counts are reals


def test_reached_counts_drafts_whose_predecessors_were_accepted():
    s = AcceptanceStats.zeros(3)
    for k, a in ((3, 1), (2, 2), (1, 0), (3, 3)):
        s.record(k, a)
    assert s.drafted == [4, 3, 2] and s.reached == [4, 3, 1] and s.accepted == [3, 2, 1]
    assert s.snapshot() == ([4, 3, 2], [4, 3, 1], [3, 2, 1])
    np.testing.assert_allclose(acceptance_from_stats(s, 4), [4 / 6, 3 / 5, 2 / 3, 0.5], rtol=1e-12)
    np.testing.assert_allclose(acceptance_from_stats([s, AcceptanceStats.zeros(3)], 2),
                               [[4 / 6, 3 / 5], [0.5, 0.5]], rtol=1e-12)
    s.reset()
    assert s.reached == [0, 0, 0]


def test_the_conditional_rate_survives_a_varying_k():
    """Verifies with K drawn per step, each draft accepted with its true conditional rate:
    ``accepted / reached`` finds the rates; ``accepted[i] / accepted[i-1]`` (what the counters
    without ``reached`` allow) does not, since a verify with K = i accepts i drafts without
    being offered draft i."""
    true = np.array([0.8, 0.5, 0.3])
    rng = np.random.default_rng(1)
    s = AcceptanceStats.zeros(3)
    for _ in range(20000):
        k = int(rng.integers(1, 4))
        a = 0
        while a < k and rng.random() < true[a]:
            a += 1
        s.record(k, a)
    est = acceptance_from_stats(s, 3)
    np.testing.assert_allclose(est, true, atol=0.02)
    naive = np.array(s.accepted[1:]) / np.array(s.accepted[:-1])
    assert np.abs(naive - true[1:]).max() > 0.1, naive


def test_the_proposer_counts_reached(make_prop):
    prop = make_prop("exact")
    H, V = prop.config.stream_size, prop.config.vocab_size
    rng = np.random.default_rng(0)
    st = prop.alloc_state()
    prop.prefill_drafter(rng.integers(0, V, 5).tolist(), rand_hiddens(rng, 5, H), st)
    P = 5
    for k, a in ((3, 1), (1, 1), (3, 0), (2, 2)):
        d = prop.propose(int(rng.integers(0, V)), rand_hiddens(rng, 1, H)[0], P, k, st)
        prop.after_verify(a, st)
        prop.catchup_drafter(d[:a], rand_hiddens(rng, a, H), st)
        P += 1 + a
    assert prop.stats.drafted == [4, 3, 2] and prop.stats.reached == [4, 2, 0] and prop.stats.accepted == [3, 1, 0]
    np.testing.assert_allclose(acceptance_from_stats(prop.stats, 3), [4 / 6, 2 / 4, 1 / 2], rtol=1e-12)
    prop.free_state(st)


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_a_policy_driven_loop_with_k0_stretches(make_prop, tiny_ckpt, mode):
    """The loop of the docs' example under the testing kit (every call checked against its
    model; exact mode's drafts against the dense oracle): a costly propose gives K = 0 steps,
    caught up token by token, then free drafting gives K = M, and the counters move only
    with the verifies."""
    from mtpkern.testing import checked, reference_weights

    prop = checked(make_prop(mode), reference_weights(tiny_ckpt) if mode == "exact" else None)
    H, V, M = prop.config.stream_size, prop.config.vocab_size, prop.num_modules
    rng = np.random.default_rng(3)
    n = 40
    t, h = rng.integers(0, V, n).tolist(), rand_hiddens(rng, n, H)
    costly, free = linear_costs(1.0, 0.0, 0.01, 0.0), linear_costs(0.0, 0.0, 0.01, 0.0)
    st = prop.alloc_state()
    prop.prefill_drafter(t[:6], h[:6], st)
    P, chosen = 6, []
    for step in range(12):
        K = choose_k(acceptance_from_stats(prop.stats, M), costly if step < 6 else free, M).k
        chosen.append(K)
        if K == 0:
            prop.catchup_drafter([t[P]], h[P - 1:P], st)
            P += 1
            continue
        drafts = prop.propose(t[P], h[P - 1], P, K, st)
        a = int(rng.integers(0, K + 1))
        t[P + 1:P + 1 + a] = drafts[:a]
        prop.after_verify(a, st)
        prop.catchup_drafter(drafts[:a], h[P:P + a], st)
        P += 1 + a
    assert chosen == [0] * 6 + [M] * 6
    assert prop.stats.verifies == 6 and prop.stats.drafted == [6] * M
    assert st.num_verified == P and st.num_hiddens == P - 1
    prop.free_state(st)


# -- properties -------------------------------------------------------------------------------------------

@st.composite
def counts(draw, k_max):
    """(accepted, reached) per position, and a second ``accepted`` never lower."""
    reached = draw(st.lists(st.integers(0, 20), min_size=k_max, max_size=k_max))
    acc = [draw(st.integers(0, r)) for r in reached]
    more = [a + draw(st.integers(0, r - a)) for a, r in zip(acc, reached)]
    return np.array(acc), np.array(more), np.array(reached)


@st.composite
def cases(draw):
    k_max = draw(st.integers(1, 8))
    acc, more, reached = draw(counts(k_max))
    a, b, c, d = (draw(st.integers(lo, 100)) for lo in (0, 0, 1, 0))    # integer seconds: exact inputs
    return k_max, acc, more, reached, linear_costs(a, b, c, d, batch_sizes=(1, 8))


@settings(max_examples=300, deadline=None)
@given(cases(), st.integers(1, 8))
def test_higher_acceptance_never_lowers_k(case, B):
    """One sequence, and a batch of B sharing one acceptance: raising any alpha_i (costs fixed)
    never lowers the chosen K."""
    k_max, acc, more, reached, costs = case
    lo, hi = acceptance_from_counts(acc, reached, k_max), acceptance_from_counts(more, reached, k_max)
    assert np.all(hi >= lo)
    for b in (1, B):
        assert choose_k(hi, costs, k_max, batch_size=b).k >= choose_k(lo, costs, k_max, batch_size=b).k


def test_per_sequence_acceptances_in_a_batch_are_not_monotone():
    """The limit the module docstring states: raising one sequence's alpha_1 makes K = 1 gain
    more, relatively, than K = 2, and the batch's K drops from 2 to 1."""
    costs = StepCosts.from_points(propose=[(2, 1, 0.0), (2, 2, 0.0)],
                                  verify=[(2, 1, 1.0), (2, 2, 1.5), (2, 3, 1.905)])
    before = choose_k([[0.5, 0.0], [1.0, 1.0]], costs, 2)
    after = choose_k([[0.9, 0.0], [1.0, 1.0]], costs, 2)
    assert (before.k, after.k) == (2, 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.data(), st.integers(1, 100), st.integers(1, 8))
def test_free_drafting_gives_k_max(k_max, data, verify_s, B):
    """No propose cost and a verify whose cost does not grow with its tokens: every draft with
    a chance of acceptance adds tokens at no cost."""
    acc, _, reached = data.draw(counts(k_max))
    costs = linear_costs(0, 0, verify_s, 0, batch_sizes=(1, 8))
    alphas = acceptance_from_counts(acc, reached, k_max)
    assert choose_k(alphas, costs, k_max, batch_size=B).k == k_max


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.data(), st.integers(1, 100), st.integers(1, 8))
def test_a_costly_propose_gives_zero(k_max, data, verify_s, B):
    acc, _, reached = data.draw(counts(k_max))
    costs = linear_costs(10**6 * verify_s, 0, verify_s, 1, batch_sizes=(1, 8))
    assert choose_k(acceptance_from_counts(acc, reached, k_max), costs, k_max, batch_size=B).k == 0


# -- input errors -----------------------------------------------------------------------------------------

GOOD = dict(propose=[(1, 1, 1.0), (1, 2, 2.0)], verify=[(1, 1, 1.0), (1, 2, 1.0)])


@pytest.mark.parametrize("propose,verify,err,msg", [
    ([(1, 1, 1.0)], GOOD["verify"], ValueError, r"propose: expected at least 2 sizes measured at B=1.*got 1"),
    ([(1, 1, 1.0), (1, 1, 2.0)], GOOD["verify"], ValueError, r"propose\[1\]: expected each \(B, size\) once"),
    ([(0, 1, 1.0), (0, 2, 1.0)], GOOD["verify"], ValueError, r"propose\[0\] B: expected an int >= 1, got 0"),
    ([(1, 0, 1.0), (1, 2, 1.0)], GOOD["verify"], ValueError, r"propose\[0\] size: expected an int >= 1, got 0"),
    ([(1, 1.0, 1.0), (1, 2, 1.0)], GOOD["verify"], TypeError, r"propose\[0\] size: expected an int, got float"),
    ([(1, True, 1.0), (1, 2, 1.0)], GOOD["verify"], TypeError, r"propose\[0\] size: expected an int, got bool"),
    (GOOD["propose"], [(1, 1, -1.0), (1, 2, 1.0)], ValueError, r"verify\[0\] seconds: expected a finite number >= 0"),
    (GOOD["propose"], [(1, 1, float("nan")), (1, 2, 1.0)], ValueError, r"verify\[0\] seconds: .*got nan"),
    (GOOD["propose"], [(1, 1)], TypeError, r"verify\[0\]: expected a \(B, size, seconds\) triple"),
    (GOOD["propose"], [], ValueError, r"verify: expected at least 2 .* got none"),
    (GOOD["propose"], "fast", TypeError, r"verify: expected \(B, size, seconds\) points, got str"),
])
def test_bad_measurements(propose, verify, err, msg):
    with pytest.raises(err, match=msg):
        StepCosts.from_points(propose, verify)


def test_bad_queries():
    costs = StepCosts.from_points(**GOOD)
    with pytest.raises(ValueError, match=r"fit: expected 'interpolate' or 'affine', got 'cubic'"):
        StepCosts.from_points(**GOOD, fit="cubic")
    with pytest.raises(ValueError, match=r"B: expected a batch size within the verify measurements' \[1, 1\], "
                                         r"got 2"):
        choose_k([0.5], costs, 1, batch_size=2)
    with pytest.raises(ValueError, match=r"k_max: expected an int in \[0, 64\], got 65"):
        choose_k([0.5] * 65, costs, 65)
    with pytest.raises(TypeError, match=r"k_max: expected an int, got float"):
        choose_k([0.5], costs, 1.0)
    with pytest.raises(ValueError, match=r"alphas: expected 2 per sequence \(k_max.*got shape \(3,\)"):
        choose_k([0.5] * 3, costs, 2)
    with pytest.raises(ValueError, match=r"alphas\[1\]: expected a probability in \[0, 1\], got 1.5"):
        choose_k([0.5, 1.5], costs, 2)
    with pytest.raises(ValueError, match=r"alphas\[0\]: expected a finite number, got nan"):
        choose_k([np.nan], costs, 1)
    with pytest.raises(ValueError, match=r"batch_size: expected None or 2 \(the rows of alphas\), got 3"):
        choose_k([[0.5], [0.5]], costs, 1, batch_size=3)
    with pytest.raises(TypeError, match=r"costs: expected a StepCosts, got dict"):
        choose_k([0.5], dict(GOOD), 1)
    with pytest.raises(TypeError, match=r"alphas: expected an array of real numbers, got list of <U1"):
        choose_k(["a"], costs, 1)
    down = StepCosts.from_points(propose=GOOD["propose"], verify=[(1, 2, 1.0), (1, 3, 2.0)])
    with pytest.raises(ValueError, match=r"costs: expected a step time > 0, got 0.0 s at K=0, B=1"):
        choose_k([0.5], down, 1)
    steep = StepCosts.from_points(propose=GOOD["propose"], verify=[(1, 3, 1.0), (1, 4, 3.0)])
    with pytest.raises(ValueError, match=r"verify: the measurements give -3 s at size 1, B=1 \(below 0"):
        choose_k([0.5], steep, 1)


def test_bad_counts():
    with pytest.raises(ValueError, match=r"accepted\[1\]: expected <= reached\[1\] = 2.0, got 3.0"):
        acceptance_from_counts([1, 3], [1, 2], 2)
    with pytest.raises(ValueError, match=r"reached\[0\]: expected a count >= 0, got -1.0"):
        acceptance_from_counts([0], [-1], 1)
    with pytest.raises(ValueError, match=r"reached: expected the shape of accepted \(2,\), got \(3,\)"):
        acceptance_from_counts([0, 0], [0, 0, 0], 2)
    with pytest.raises(ValueError, match=r"prior: expected pseudo-counts > 0 \(a Beta prior\), got \(0.0, 1.0\)"):
        acceptance_from_counts([0], [0], 1, prior=(0, 1))
    with pytest.raises(TypeError, match=r"stats\[1\]: expected an AcceptanceStats, got dict"):
        acceptance_from_stats([AcceptanceStats.zeros(1), {}], 1)
    with pytest.raises(ValueError, match=r"stats: expected an AcceptanceStats or a list of at least one"):
        acceptance_from_stats([], 1)


def test_a_refused_record_changes_nothing():
    s = AcceptanceStats.zeros(2)
    s.record(2, 1)
    before = s.snapshot(), s.verifies, s.accepted_total
    for k, a, msg in ((3, 0, r"k: expected in \[0, 2\], got 3"), (1, 2, r"a: expected in \[0, 1\], got 2")):
        with pytest.raises(ValueError, match=msg):
            s.record(k, a)
    assert (s.snapshot(), s.verifies, s.accepted_total) == before
    with pytest.raises(ValueError, match=r"positions: expected in \[1, 64\], got 0"):
        AcceptanceStats.zeros(0)


# -- the docs ---------------------------------------------------------------------------------------------

def test_the_api_example_runs():
    """docs/api.md's example (measure, read the counters, choose K, propose or catch up) as pasted."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    start = text.index("## Choosing the number of drafts per step")
    section = text[start:text.index("\n## ", start + 1)]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "docs/api.md", "exec"), {"__name__": "api_example"})


def test_a_cost_table_built_by_hand_is_checked():
    with pytest.raises(ValueError, match=r"verify: expected at B=1 at least 2 increasing sizes"):
        CostTable("verify", (1,), (np.array([2.0, 1.0]),), (np.array([1.0, 1.0]),))
    with pytest.raises(ValueError, match=r"verify: expected sorted distinct batch sizes"):
        CostTable("verify", (2, 1), (np.array([1.0, 2.0]),) * 2, (np.array([1.0, 1.0]),) * 2)
    with pytest.raises(TypeError, match=r"propose: expected a CostTable, got dict"):
        StepCosts({}, CostTable.from_points("verify", GOOD["verify"]))


# -- optimism and the catch-up's cost ------------------------------------------------------------------

def test_optimism_reads_an_upper_bound_that_shrinks_with_counts():
    """Beta(a, b)'s mean plus z standard deviations, at most 1; z = 0 is the mean."""
    fresh = acceptance_from_counts([0.0], [0.0], 1, optimism=1.0)
    assert fresh.tolist() == pytest.approx([0.5 + (1 / 12) ** 0.5])            # Beta(1, 1): sd = sqrt(1/12)
    counted = acceptance_from_counts([50.0], [100.0], 1, optimism=1.0)[0]
    a, b = 51.0, 51.0
    assert counted == pytest.approx(0.5 + (a * b / ((a + b) ** 2 * (a + b + 1))) ** 0.5)
    assert 0.5 < counted < fresh[0]
    assert acceptance_from_counts([9.0], [9.0], 1, optimism=50.0).tolist() == [1.0]
    assert acceptance_from_counts([3.0], [4.0], 1, optimism=0.0).tolist() == [4 / 6]
    with pytest.raises(ValueError, match="optimism"):
        acceptance_from_counts([0.0], [0.0], 1, optimism=-1.0)


def test_optimism_gets_a_policy_out_of_a_pessimistic_start():
    """A step at 0.5 acceptance does not pay for drafting (propose 2.5 s a draft, verify 4 s):
    the posterior mean alone picks K = 0 before any count, and since a K = 0 step offers no draft
    it would stay there; one standard deviation of optimism drafts, and once counts say 0.5 the
    choice is K = 0 on evidence."""
    costs = linear_costs(0.0, 2.5, 4.0, 0.0)
    assert choose_k(acceptance_from_counts([0.0] * 3, [0.0] * 3, 3), costs, 3).k == 0
    assert choose_k(acceptance_from_counts([0.0] * 3, [0.0] * 3, 3, optimism=1.0), costs, 3).k > 0
    counted = acceptance_from_counts([500.0] * 3, [1000.0] * 3, 3, optimism=1.0)
    assert choose_k(counted, costs, 3).k == 0


def test_the_catchup_cost_by_hand():
    """catch-up c(n) = 1 + n s: K = 0 pays c(1) = 2 s; K = 1 at alpha 0.5 pays c(1) half the time
    (1 s expected); K = 2 at alphas (0.5, 0.5): P(a=1) = 0.25, P(a=2) = 0.25: 0.25 * 2 + 0.25 * 3."""
    costs = StepCosts.from_points(propose=[(1, 1, 1.0), (1, 2, 2.0)], verify=[(1, 1, 4.0), (1, 2, 4.0)],
                                  catchup=[(1, 1, 2.0), (1, 2, 3.0)])
    a = np.array([0.5, 0.5])
    assert costs.catchup_seconds(a, 1).tolist() == pytest.approx([2.0, 1.0, 1.25])
    got = choose_k(a, costs, 2)
    assert got.step_seconds.tolist() == pytest.approx([6.0, 6.0, 7.25])       # verify + propose + catch-up
    assert got.tokens_per_second.tolist() == pytest.approx([1 / 6, 1.5 / 6, 1.75 / 7.25])
    assert got.k == 1
    # without the catch-up table K = 0 looks cheaper than it is: 1 / 4 against K = 1's 1.5 / 5
    bare = choose_k(a, StepCosts(costs.propose, costs.verify), 2)
    assert bare.step_seconds.tolist() == pytest.approx([4.0, 5.0, 6.0])
    with pytest.raises(TypeError, match="catchup: expected a CostTable or None"):
        StepCosts(costs.propose, costs.verify, "fast")
