// The torch headers that most translation units include, parsed once per build: setup.py
// compiles this file into GCC's precompiled header with the sources' own flags and includes
// it ahead of each source (parsing them took 6-12 s of each file's compile). The sources
// still include what they use, so a compiler without it builds the same code.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>
