# `cmake --install build [--prefix DIR]`: what a deployment needs, nothing else.
#   bin/kvshade-server, bin/kvshade                         (component runtime)
#   lib/libkvshade.so.1 (+ libkvshade.so, and libkvshade_cuda.so: its CUDA backend, in a
#   build with CUDA), include/kvshade/kvshade.h,
#   lib/cmake/kvshade/ (find_package(kvshade) -> kvshade::client, the C ABI),
#   lib/pkgconfig/kvshade.pc                               (component client)
#   the Python package kvshade in KVSHADE_INSTALL_PYTHONDIR (component python)
# Paths follow GNUInstallDirs (lib/x86_64-linux-gnu under /usr on Debian). The
# libraries the binaries link are Debian packages (scripts/install-deps.sh names them;
# deploy/docker/Dockerfile installs the runtime ones). tests/install/ checks the result.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
if(NOT TARGET kvshade-server OR NOT TARGET kvshade OR NOT TARGET kvshade_c)
  message(STATUS "kvshade: no install rules (kvshade-server, kvshade or libkvshade not built)")
  return()
endif()

install(TARGETS kvshade-server kvshade
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)

# libkvshade: exported as kvshade::client (the C ABI; the C++ client is not installed: it
# is a static library over gRPC, protobuf and the kernels, for in-tree use).
set_target_properties(kvshade_c PROPERTIES EXPORT_NAME client)
install(TARGETS kvshade_c EXPORT kvshadeTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT client
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# The CUDA backend plugin beside it (libkvshade.so loads it from its own directory at the
# first use of a CUDA backend; common/cuda_plugin_abi.h).
if(TARGET kvshade_cuda)
  install(TARGETS kvshade_cuda LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT client)
endif()
install(FILES ${PROJECT_SOURCE_DIR}/client/include/kvshade/kvshade.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvshade COMPONENT client)

set(KVSHADE_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvshade)
install(EXPORT kvshadeTargets NAMESPACE kvshade:: DESTINATION ${KVSHADE_CMAKE_DIR}
        FILE kvshadeTargets.cmake COMPONENT client)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/kvshadeConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/install/kvshadeConfig.cmake
                              INSTALL_DESTINATION ${KVSHADE_CMAKE_DIR})
# 0.x: a minor version may change the ABI (kvshade_abi_version() says which one).
write_basic_package_version_file(${PROJECT_BINARY_DIR}/install/kvshadeConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/install/kvshadeConfig.cmake
              ${PROJECT_BINARY_DIR}/install/kvshadeConfigVersion.cmake
        DESTINATION ${KVSHADE_CMAKE_DIR} COMPONENT client)

# kvshade.pc, relocatable: prefix is found from the .pc file's own directory, so the tree
# works wherever `cmake --install --prefix` puts it.
file(RELATIVE_PATH KVSHADE_PC_TO_PREFIX
     /prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig /prefix)
configure_file(${CMAKE_CURRENT_LIST_DIR}/kvshade.pc.in ${PROJECT_BINARY_DIR}/install/kvshade.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/install/kvshade.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT client)

# The Python package (pure Python over libkvshade through ctypes; it finds the library
# installed above by its soname or relative to itself). Debian's interpreter reads
# /usr/lib/python3/dist-packages and /usr/local/lib/python3.X/dist-packages.
if(NOT DEFINED KVSHADE_INSTALL_PYTHONDIR)
  if(CMAKE_INSTALL_PREFIX STREQUAL "/usr")
    set(KVSHADE_INSTALL_PYTHONDIR lib/python3/dist-packages)
  else()
    find_program(KVSHADE_INSTALL_PYTHON3 python3 PATHS /usr/bin NO_DEFAULT_PATH)
    set(KVSHADE_INSTALL_PYTHONDIR lib/python3/dist-packages)
    if(KVSHADE_INSTALL_PYTHON3)
      execute_process(COMMAND ${KVSHADE_INSTALL_PYTHON3} -c
                              "import sys; print('%d.%d' % sys.version_info[:2])"
                      OUTPUT_VARIABLE KVSHADE_PY_VER OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
      if(KVSHADE_PY_VER)
        set(KVSHADE_INSTALL_PYTHONDIR lib/python${KVSHADE_PY_VER}/dist-packages)
      endif()
    endif()
  endif()
endif()
set(KVSHADE_INSTALL_PYTHONDIR ${KVSHADE_INSTALL_PYTHONDIR} CACHE STRING
    "Where `cmake --install` puts the Python package (relative to the prefix)")
install(DIRECTORY ${PROJECT_SOURCE_DIR}/client/python/kvshade
        DESTINATION ${KVSHADE_INSTALL_PYTHONDIR} COMPONENT python
        PATTERN "__pycache__" EXCLUDE PATTERN "*.pyc" EXCLUDE)
