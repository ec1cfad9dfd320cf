# nq_add_proto_library(<target> PROTOS <files...>)
# Generates C++ protobuf and gRPC code into the build tree at build time; generated code is
# never committed (STYLE.md 14).
function(nq_add_proto_library target)
  cmake_parse_arguments(ARG "" "" "PROTOS" ${ARGN})
  set(out_dir "${CMAKE_CURRENT_BINARY_DIR}/gen")
  file(MAKE_DIRECTORY "${out_dir}")
  get_target_property(grpc_plugin gRPC::grpc_cpp_plugin LOCATION)
  set(srcs)
  foreach(proto ${ARG_PROTOS})
    get_filename_component(abs "${proto}" ABSOLUTE)
    file(RELATIVE_PATH rel "${CMAKE_CURRENT_SOURCE_DIR}" "${abs}")
    string(REGEX REPLACE "\\.proto$" "" stem "${rel}")
    set(gen "${out_dir}/${stem}.pb.cc" "${out_dir}/${stem}.pb.h"
            "${out_dir}/${stem}.grpc.pb.cc" "${out_dir}/${stem}.grpc.pb.h")
    add_custom_command(
      OUTPUT ${gen}
      COMMAND protobuf::protoc
        --proto_path=${CMAKE_CURRENT_SOURCE_DIR}
        --cpp_out=${out_dir}
        --grpc_out=${out_dir}
        --plugin=protoc-gen-grpc=${grpc_plugin}
        ${rel}
      DEPENDS "${abs}" protobuf::protoc gRPC::grpc_cpp_plugin
      WORKING_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}"
      COMMENT "protoc ${rel}")
    list(APPEND srcs ${gen})
  endforeach()
  add_library(${target} STATIC ${srcs})
  target_include_directories(${target} PUBLIC "${out_dir}")
  target_link_libraries(${target} PUBLIC protobuf::libprotobuf gRPC::grpc++)
  # Generated code is not ours to warn about.
  target_compile_options(${target} PRIVATE -w)
endfunction()
