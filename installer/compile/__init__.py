"""A local compile: nvcc and C++ flags and the extension (native), the glibc 2.28 link (glibc_floor),
the manylinux tag (platform_tag), the build record (build_record), and local_build, which checks the
toolchain, compiles and labels a release wheel. Imports core, detect and choose.
"""
