"""A rounding-level figure quoted as exact digits is refused before any run, on every CPU.

Lesson 03 once quoted the logit difference of deepspeed_inference.py as 2.86e-06 (tolerance
0.0001); another CPU's kernels printed 3.81e-06, and the quote failed there only. The quote check
now refuses such a figure unless it carries `~` (quoted_output.unmarked_rounding), so the quote
fails wherever the suite runs, and no quote of the course carries one.
"""

import quoted_output
from conftest import quoted_pairs

AS_IT_WAS = "max |deepspeed - plain| over (4, 32, 64) logits: 2.86e-06 (tolerance 0.0001)"
AS_IT_IS = "max |deepspeed - plain| over (4, 32, 64) logits: ~2.9e-06 (tolerance 0.0001)"


def test_an_unmarked_rounding_level_figure_is_refused_even_where_it_matches():
    # the run that printed these very digits refuses the quote too
    assert quoted_output.check(AS_IT_WAS, AS_IT_WAS + "\n")
    assert quoted_output.unmarked_rounding(AS_IT_WAS) == ["2.86e-06"]
    # marked, it is not compared: another CPU's 3.81e-06 passes
    assert quoted_output.check(AS_IT_IS, AS_IT_WAS.replace("2.86e-06", "~3.8e-06")) == []


def test_what_is_not_rounding_level_stays_compared():
    for line in [
        "hand-written sync BN equal (max |diff| < 1e-05); plain BatchNorm off by up to 0.4696",
        "max |d logits      - one process|  wrong: 1.45e-03, right: ~2.3e-10",  # a bug's size
        "fsdp1 vs fsdp2, wrap block: max |w1 - w2| = 0.0e+00 after 4 steps",  # exact zero
        "adamw and eps 1e-8 / 4: step 40 loss 0.8180",  # a setting, not a difference
        "step 10 | loss 2.3456 | 812 samples/s",
    ]:
        assert quoted_output.unmarked_rounding(line) == [], line
    # below a tolerance the line prints, with or without a difference word
    assert quoted_output.unmarked_rounding("logits 3.0e-06 (tol=1e-05)") == ["3.0e-06"]
    assert quoted_output.unmarked_rounding("max |w - ref| = 0.00002 after 8 steps") == ["0.00002"]


def test_no_quote_of_the_course_carries_an_unmarked_rounding_level_figure():
    pairs = quoted_pairs()
    assert len(pairs) >= 30
    found = [f"{p['doc'].name}:{p['line']}: {line.strip()}" for p in pairs
             for line in p["quote"].splitlines() if quoted_output.unmarked_rounding(line)]
    assert found == []
