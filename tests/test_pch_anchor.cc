// The source of the nq_test_pch target (tests/CMakeLists.txt), which exists to build the test
// binaries' shared precompiled header; it compiles to nothing.
