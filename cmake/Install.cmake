# `cmake --install BUILD [--prefix P]`: mrd and mrctl, the C++ client
# library as a CMake package (find_package(mrd CONFIG) -> mrd::client) and a
# pkg-config module (mrd-client), the protos, the systemd unit and the docs.
# The client's headers need no server header: they include only
# client/lib/*.h, mrd/status.h, mrd/status_proto.h, mrd/unique_fd.h and the
# generated mrd/v1/*.
# All of them live under <prefix>/include/mrd, which is the include path.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS mrd mrctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS mrd_client mrd_status mrd_status_proto mrd_proto mrd_health_proto
  EXPORT mrdTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})

set(MRD_INCLUDE_ROOT ${CMAKE_INSTALL_INCLUDEDIR}/mrd)
set(MRD_CLIENT_HEADERS buffer client completion_stream lam memfd mr mrd_client
  name_watch options peer_ticket registration session status)
list(TRANSFORM MRD_CLIENT_HEADERS PREPEND ${PROJECT_SOURCE_DIR}/client/lib/)
list(TRANSFORM MRD_CLIENT_HEADERS APPEND .h)
install(FILES ${MRD_CLIENT_HEADERS} DESTINATION ${MRD_INCLUDE_ROOT}/client/lib)
install(FILES ${PROJECT_SOURCE_DIR}/proto/mrd/status.h
  ${PROJECT_SOURCE_DIR}/proto/mrd/status_proto.h
  ${PROJECT_SOURCE_DIR}/proto/mrd/unique_fd.h
  DESTINATION ${MRD_INCLUDE_ROOT}/mrd)
foreach(proto mrd fd peer)
  install(FILES ${PROJECT_BINARY_DIR}/proto/gen/mrd/v1/${proto}.pb.h
    ${PROJECT_BINARY_DIR}/proto/gen/mrd/v1/${proto}.grpc.pb.h
    DESTINATION ${MRD_INCLUDE_ROOT}/mrd/v1)
  install(FILES ${PROJECT_SOURCE_DIR}/proto/mrd/v1/${proto}.proto
    DESTINATION ${CMAKE_INSTALL_DATADIR}/mrd/proto/mrd/v1)
endforeach()

install(EXPORT mrdTargets NAMESPACE mrd::
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/mrd)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/mrdConfig.cmake.in
  ${PROJECT_BINARY_DIR}/mrdConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/mrd)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/mrdConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/mrdConfig.cmake
  ${PROJECT_BINARY_DIR}/mrdConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/mrd)

file(RELATIVE_PATH MRD_PC_TO_PREFIX
  /prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig /prefix)
configure_file(${PROJECT_SOURCE_DIR}/cmake/mrd-client.pc.in
  ${PROJECT_BINARY_DIR}/mrd-client.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/mrd-client.pc
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# The systemd unit, its ExecStart pointed at the installed mrd (the prefix
# is the one `cmake --install --prefix` gives, read at install time).
install(CODE "
  set(bin \"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_BINDIR}/mrd\")
  set(dest \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/lib/systemd/system\")
  file(READ \"${PROJECT_SOURCE_DIR}/deploy/systemd/mrd.service\" unit)
  string(REPLACE \"/usr/local/bin/mrd\" \"\${bin}\" unit \"\${unit}\")
  string(REPLACE \"/usr/local/share/doc/mrd\"
    \"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_DOCDIR}\" unit \"\${unit}\")
  file(WRITE \"\${dest}/mrd.service\" \"\${unit}\")
  message(STATUS \"Installing: \${dest}/mrd.service\")
")
install(FILES ${PROJECT_SOURCE_DIR}/README.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR}
  FILES_MATCHING PATTERN "*.md")

# The Python client (client/python) and its generated modules, where
# Debian's python3 looks under the prefix (lib/python3.X/dist-packages).
execute_process(COMMAND /usr/bin/python3 -c
  "import sys; print('lib/python%d.%d/dist-packages' % sys.version_info[:2])"
  OUTPUT_VARIABLE MRD_PYTHON_DIR OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE python_rc)
if(python_rc EQUAL 0)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/client/python/mrd_client
    ${MRD_PYTHON_GEN}/mrd ${MRD_PYTHON_GEN}/mrd_client_health
    ${MRD_PYTHON_GEN}/mrd_client_policy
    DESTINATION ${MRD_PYTHON_DIR} FILES_MATCHING PATTERN "*.py")
endif()
