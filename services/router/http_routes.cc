#include "services/router/http_routes.h"

#include <nlohmann/json.hpp>

#include "services/common/http_server.h"
#include "services/common/metrics/registry.h"
#include "services/common/status_http.h"
#include "services/router/inference_service.h"

namespace nq::router {
namespace {

void SendError(httplib::Response& response, const absl::Status& status) {
  HttpError error = ToHttpError(status);
  response.status = error.http_status;
  response.set_content(error.body, "application/json");
}

}  // namespace

void AddRouterRoutes(httplib::Server& server, HttpRoutesConfig config) {
  AddHealthRoute(server, config.serving);
  AddMetricsRoute(server, metrics::Registry::Default());

  server.Get("/v1/models", [config](const httplib::Request&, httplib::Response& response) {
    absl::StatusOr<nq::v1::ModelInfo> info = CurrentModelInfo(*config.worker, config.served_model_name);
    if (!info.ok()) return SendError(response, info.status());
    nlohmann::json model = {
        {"id", info->id()},
        {"object", "model"},
        {"created", info->created_unix()},
        {"owned_by", "nestquant"},
        {"max_model_len", info->max_model_len()},
    };
    nlohmann::json body = {{"object", "list"}, {"data", nlohmann::json::array({model})}};
    response.set_content(body.dump(), "application/json");
  });

  // Unknown paths get an OpenAI-shaped 404 rather than httplib's empty body.
  server.set_error_handler([](const httplib::Request& request, httplib::Response& response) {
    if (response.status == 404) {
      SendError(response, absl::NotFoundError("no route for " + request.method + " " + request.path));
    }
  });
}

}  // namespace nq::router
