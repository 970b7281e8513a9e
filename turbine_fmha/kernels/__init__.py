"""The kernels: variant specs and their names (variants, append_kernel,
naming), each kernel's argument list declared once (signature), and the
iree-turbine CustomOps that render the MLIR templates (custom_ops; imports
torch and iree-turbine, build time only)."""
