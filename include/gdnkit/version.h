// gdnkit's version: the one place it is written.
//
// Everything else reads these three numbers: CMakeLists.txt parses them into project(VERSION) (so
// find_package(gdnkit 0.1) and gdnkitConfigVersion.cmake), pyproject.toml's regex metadata provider into the
// Python package's version, and the library, `gdnkit --version`, gdnkit.__version__ and build_info() use the
// macros below. To release a new version, change the numbers here and nowhere else.
#pragma once

#define GDNKIT_VERSION_MAJOR 0
#define GDNKIT_VERSION_MINOR 1
#define GDNKIT_VERSION_PATCH 0

#define GDNKIT_VERSION_STRINGIFY_(x) #x
#define GDNKIT_VERSION_EXPAND_(x) GDNKIT_VERSION_STRINGIFY_(x)
// "MAJOR.MINOR.PATCH", a string literal ("0.1.0").
#define GDNKIT_VERSION_STRING                                                                   \
  GDNKIT_VERSION_EXPAND_(GDNKIT_VERSION_MAJOR) "." GDNKIT_VERSION_EXPAND_(GDNKIT_VERSION_MINOR) \
      "." GDNKIT_VERSION_EXPAND_(GDNKIT_VERSION_PATCH)
// MAJOR * 10000 + MINOR * 100 + PATCH, for #if comparisons (0.1.0: 100).
#define GDNKIT_VERSION_NUMBER (GDNKIT_VERSION_MAJOR * 10000 + GDNKIT_VERSION_MINOR * 100 + GDNKIT_VERSION_PATCH)
