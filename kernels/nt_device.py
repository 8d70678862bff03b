"""Device helpers of the ninetoothed chain kernel (kernels/elementwise_chain.py): fp32 math on
tiles, which ninetoothed inlines into the generated application. An epilogue spec's `nt_code`
calls them by name and lists them in its `nt_helpers` (kernels/epilogue/spec.py).

Inlining substitutes arguments textually, so pass a local, not a load (an argument that is
itself a load would be loaded once per use), and make every call a statement's whole right-hand
side: ninetoothed 0.26 drops the inlined body of a call nested in an expression.
"""

import ninetoothed.language as ntl


def relu_fp32(x):
    # ntl.maximum, not max(): the interpreter does not translate Python's max.
    return ntl.maximum(x, 0.0)


def sigmoid_fp32(x):
    return ntl.sigmoid(x)


def silu_fp32(x):
    return x * ntl.sigmoid(x)


def gelu_erf_fp32(x):
    return 0.5 * x * (1.0 + ntl.erf(x * 0.7071067811865476))


def gelu_tanh_fp32(x):
    # 0.5 * (1 + tanh(u)) == sigmoid(2u), and Triton has sigmoid but no tanh;
    # 1.5957691216057308 is 2 * sqrt(2 / pi).
    return x * ntl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))


def rms_normalize_fp32(x, weight, eps, num_cols):
    # x is a (rows, block) tile whose lanes past the row end are zero.
    mean_square = ntl.sum(x * x, axis=1, keep_dims=True) / num_cols
    return x * ntl.rsqrt(mean_square + eps) * weight
