"""The engine's algorithms over infini_dist.kernels: `Algorithm` adapters that plan a span, size
and fetch its buffers and bind its launches. The kernels know nothing of the engine; what they
need from it comes in as arguments."""
