#include "gpu/gpu_harness.h"

#include <stdexcept>

namespace gdnkit::test {
namespace {
void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(err) + " " + cudaGetErrorString(err));
}
}  // namespace

DeviceProblem::DeviceProblem(const Problem& host) {
  check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  for (const Buffer& b : host.buffers()) {
    Mirror m{b.name, nullptr, b.bytes.size()};
    check(cudaMalloc(&m.data, m.bytes), ("cudaMalloc " + b.name).c_str());
    mirrors_.push_back(m);
  }
  upload(host);
}

DeviceProblem::~DeviceProblem() {
  if (stream_) cudaStreamSynchronize(stream_);
  for (Mirror& m : mirrors_) cudaFree(m.data);
  if (stream_) cudaStreamDestroy(stream_);
}

const DeviceProblem::Mirror& DeviceProblem::find(const std::string& name) const {
  for (const Mirror& m : mirrors_)
    if (m.name == name) return m;
  throw std::invalid_argument("DeviceProblem: no buffer named " + name);
}

void* DeviceProblem::device(const std::string& name) const { return find(name).data; }

Resolver DeviceProblem::resolver() const {
  return [this](const Buffer& b) { return device(b.name); };
}

void DeviceProblem::upload(const Problem& host, const std::string& name) {
  const Mirror& m = find(name);
  const Buffer& b = host.buffer(name);
  if (b.bytes.size() != m.bytes) throw std::invalid_argument("DeviceProblem: size of " + name + " changed");
  check(cudaMemcpyAsync(m.data, b.bytes.data(), m.bytes, cudaMemcpyHostToDevice, stream_), "upload");
  check(cudaStreamSynchronize(stream_), "upload sync");
}

void DeviceProblem::upload(const Problem& host) {
  for (const Mirror& m : mirrors_) upload(host, m.name);
}

void DeviceProblem::download(Problem& host, const std::string& name) const {
  const Mirror& m = find(name);
  Buffer& b = host.buffer(name);
  check(cudaStreamSynchronize(stream_), "kernel (sync before download)");
  check(cudaMemcpy(b.bytes.data(), m.data, m.bytes, cudaMemcpyDeviceToHost), "download");
}

void DeviceProblem::download(Problem& host) const {
  for (const Mirror& m : mirrors_)
    if (host.buffer(m.name).is_output) download(host, m.name);
}

::testing::AssertionResult OutputsClose(const Problem& got, const Problem& ref, double tol) {
  return RelClose("o", got.read_tokens("o"), ref.read_tokens("o"), tol);
}

::testing::AssertionResult SlotsClose(const Problem& got, const Problem& ref, const std::vector<int64_t>& slots,
                                      double tol, const std::string& name) {
  for (const int64_t slot : slots) {
    auto r = RelClose(name + " slot " + std::to_string(slot), got.read_state(name, slot), ref.read_state(name, slot), tol);
    if (!r) return r;
  }
  return ::testing::AssertionSuccess() << slots.size() << " slots close";
}

}  // namespace gdnkit::test
