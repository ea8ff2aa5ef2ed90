// The web page's static files (services/gateway/web/), compiled into the
// binary at build time by embed_web.cmake: no CDN, no file needed at run time.
#ifndef VLM_SERVICES_GATEWAY_WEB_ASSETS_H_
#define VLM_SERVICES_GATEWAY_WEB_ASSETS_H_

#include <string_view>

namespace vlm::gateway {

struct WebAsset {
  std::string_view path;          // "/index.html", "/app.js", "/style.css"
  std::string_view content_type;  // with charset
  std::string_view body;
};

// The asset served at `path`, or null.
const WebAsset* FindWebAsset(std::string_view path);

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_WEB_ASSETS_H_
