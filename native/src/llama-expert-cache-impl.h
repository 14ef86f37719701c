// Spark expert cache: what its source files share (not part of the API; llama-expert-cache.h is).
#pragma once

#include "llama-expert-cache.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <unordered_set>

namespace llama_expert_cache_impl {

constexpr size_t RECIPE_MAX = 32; // ops between the expert matmuls' input and the down projection

std::string fmt(const char * f, ...);
bool is_gpu(ggml_backend_dev_t dev);

// the host nodes' callbacks (llama-expert-cache-step.cpp)
void node_remap(ggml_tensor * dst, int ith, int nth, void * userdata);
void node_count(ggml_tensor * dst, int ith, int nth, void * userdata);
void node_partial(ggml_tensor * dst, int ith, int nth, void * userdata);

} // namespace llama_expert_cache_impl
