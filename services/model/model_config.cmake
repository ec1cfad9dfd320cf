# config.json parsing for the model library (issue #3). Included from
# services/model/CMakeLists.txt.
add_library(nq_model_config STATIC
  ${CMAKE_CURRENT_LIST_DIR}/config_fields.cc
  ${CMAKE_CURRENT_LIST_DIR}/model_config.cc
  ${CMAKE_CURRENT_LIST_DIR}/model_config_parse.cc
  ${CMAKE_CURRENT_LIST_DIR}/model_config_validate.cc
  ${CMAKE_CURRENT_LIST_DIR}/rope_config.cc)
target_include_directories(nq_model_config PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(nq_model_config PUBLIC
  absl::status absl::statusor absl::strings nlohmann_json::nlohmann_json)
