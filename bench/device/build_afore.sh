#!/usr/bin/env bash
# Source from a device script (repository root as the working directory): builds afore's C++
# extensions with plain cmake on a host without a package index, once per checkout (the .so
# files are copied next to the Python package); returns 1 after printing the build log's tail.
if [ ! -f afore/_shm*.so ] || [ ! -f afore/_scheduler_core*.so ] || [ ! -f afore/_ffn*.so ]; then
  cmake -S . -B /tmp/afore-build -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" > /tmp/cmake.log \
    && cmake --build /tmp/afore-build -j "$(nproc)" > /tmp/build.log && cp /tmp/afore-build/_*.so afore/ \
    || { tail -30 /tmp/cmake.log /tmp/build.log; return 1; }
fi
