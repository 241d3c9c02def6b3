"""lipdp: differentially private deep learning without per-sample clipping.

Lipschitz-constrained layers make the sensitivity of every minibatch gradient
known in advance, so Gaussian noise can be calibrated without clipping
per-example gradients (Béthune et al., *DP-SGD Without Clipping: The Lipschitz
Neural Network Way*, ICLR 2024).
"""

__version__ = "0.1.0"
