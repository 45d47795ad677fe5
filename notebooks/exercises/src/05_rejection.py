# %% [markdown]
# # Exercise 5: the rejection sampler of speculative decoding
#
# Speculative decoding lets a small *draft* model propose tokens that the large *target* model
# then checks, several at once, in one forward pass. The check must not change what the target
# would have generated: each emitted token must be distributed exactly as the target's
# distribution `p`, whatever the draft's distribution `q` was. The rule that does it
# (Leviathan et al. 2023, Chen et al. 2023; vLLM's `RejectionSampler`) is yours to write, for
# one draft position.
#
# ## The rule
#
# The draft model drew `draft` from `q`.
#
# * **Accept** it with probability `min(1, p[draft] / q[draft])`.
# * Otherwise **reject** it and draw the token from the *residual* distribution
#   `max(0, p - q)`, normalised: the probability mass `p` has where `q` falls short.
#
# Then a token `t` comes out with probability `min(p[t], q[t])` (drafted and accepted) plus
# `(1 - sum(min(p, q))) * residual[t]`, which is exactly `p[t]`. No rule accepts more often
# than this one: its acceptance rate is `sum(min(p, q))`.
#
# ## Graded by distribution
#
# Random draws cannot be compared one by one, so the grader compares distributions: for
# (p, q) pairs drawn with hypothesis (a fixed seed), it calls your `verify` 2000 times with
# drafts drawn from `q`, and checks that your tokens' frequencies are `p` and your acceptance
# rate is `sum(min(p, q))`, each within 5 standard errors.

# %%
import torch

import workbench.exercises as ex
from workbench.exercises.rejection import Case

# A pair worked by hand: p = [0.5, 0.5], q = [0.8, 0.2]. sum(min(p, q)) = 0.7 of the drafts are
# accepted; the residual max(0, p - q) = [0, 0.3] -> [0, 1]: every rejected draft becomes token 1.
by_hand = Case(p_weights=(1, 1), q_weights=(4, 1))
print(by_hand)

# %% [markdown]
# ## Your code
#
# Take all randomness from `generator` (e.g. `torch.rand(1, generator=generator)`,
# `torch.multinomial(weights, 1, generator=generator)`), so the feedback is the same on
# every run.

# %%
def verify(p, q, draft, generator):
    """One draft position: p, q are the target's and the draft's probabilities (1-D tensors),
    draft a token drawn from q. Return (accepted, token): (True, draft), or (False, a token
    drawn from the residual distribution). Draw randomness from generator only."""
    # your code here
    return True, draft


# %% [markdown]
# ## Check it
#
# The stub accepts every draft, so it emits `q`, not `p`:

# %%
print(ex.check("rejection", verify, workloads=[by_hand]))

# %%
result = ex.check("rejection", verify)
result

# %%
print(result.unit, result.first_wrong_step)
print(result.hint())

# %% [markdown]
# `result.show()` draws the case: `p`, `q`, the reference's emitted frequencies and yours.

# %%
# NBVAL_IGNORE_OUTPUT
result.show()

# %% [markdown]
# ## When it passes
#
# `check` prints `PASSED rejection: ...`. Then vary the draft: how does the acceptance rate --
# and so the speed-up of speculative decoding -- depend on how far `q` is from `p`? Tutorial
# 10 measures it on the embedded model with its draft model.
