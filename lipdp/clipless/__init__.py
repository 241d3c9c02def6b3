"""The clipless family (Béthune et al., ICLR 2024): Lipschitz layers whose per-example
gradient norms are bounded in advance, the bound pass, Lipschitz losses, projections,
dynamic clipping of cotangents, the audit of the bounds and their tightness report
(:mod:`lipdp.clipless.tightness`: measured norms against the declared bounds).

:mod:`lipdp.clipless.model` holds ``DP_Model``/``DP_Sequential``,
:mod:`lipdp.clipless.layers` the DP layers (one module per layer family).
"""
