"""What the target is: its interpreter (interpreter), torch from its files (torch_files), the driver
and GPUs (driver), nvcc and the host compiler (toolchain), gathered into a TargetEnv by
detect.detect. Imports core only.
"""
