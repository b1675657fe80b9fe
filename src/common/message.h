// Error-message text without iostreams: strings and numbers are appended with std::to_string and
// snprintf, so building a message touches no std::locale facet.
// NOTES: the Python extension crashed (SIGSEGV in std::ostream::_M_insert<long>, i.e. the num_put facet
// of an std::ostringstream) when a validation message formatted a number on the GPU machine (Ubuntu 24.04,
// gcc 13.3, Python 3.12 under pytest); messages of strings alone did not. Library and binding both build
// their messages here.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

#include "gdnkit/types.h"

namespace gdnkit::msg {

inline void append(std::string& s, std::string_view v) { s.append(v); }
inline void append(std::string& s, const char* v) { s.append(v ? v : "(null)"); }
inline void append(std::string& s, const std::string& v) { s.append(v); }
inline void append(std::string& s, char c) { s.push_back(c); }
inline void append(std::string& s, bool b) { s.append(b ? "true" : "false"); }
template <class T>
  requires std::is_integral_v<T>
inline void append(std::string& s, T v) {
  s.append(std::to_string(v));
}
inline void append(std::string& s, double v) {  // as an ostream with default flags: %g, 6 digits
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  s.append(buf);
}
inline void append(std::string& s, float v) { append(s, double(v)); }
inline void append(std::string& s, const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  s.append(buf);
}

template <class... Args>
std::string cat(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

// Throws gdnkit::Error(kInvalidArgument) with the concatenated message.
template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(ErrorCode::kInvalidArgument, cat(args...));
}

}  // namespace gdnkit::msg
