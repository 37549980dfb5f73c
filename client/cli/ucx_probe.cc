// UcxLanesTo (ucx_probe.h): an endpoint on a throwaway worker, ucp_ep_print_info into a
// memory stream, and the tl/device of each lane picked out of its text.
#include "ucx_probe.h"

#include <ucp/api/ucp.h>

#include <cstdio>
#include <cstdlib>
#include <set>

#include "absl/strings/str_join.h"
#include "kvshade/transport/ucx_core.h"

namespace kvshade::cli {

namespace ucx = kvshade::transport::ucx;

absl::StatusOr<std::string> UcxLanesTo(const std::string& address, const std::string& transports) {
  auto raw = ucx::DecodeWorkerAddress(address);
  if (!raw.ok()) return raw.status();
  auto loop = ucx::UcxLoop::Start(transports, {});
  if (!loop.ok()) return loop.status();
  ucx::UcxLoop* l = loop->get();
  auto text = l->Call<std::string>([l, &raw]() -> absl::StatusOr<std::string> {
    auto ep = ucx::UcxEndpoint::Connect(l->worker(), *raw);
    if (!ep.ok()) return ep.status();
    char* buf = nullptr;
    size_t len = 0;
    FILE* f = open_memstream(&buf, &len);
    if (f == nullptr) return absl::InternalError("open_memstream failed");
    ucp_ep_print_info((*ep)->get(), f);
    std::fclose(f);
    std::string s(buf, len);
    std::free(buf);
    return s;
  });
  (*loop)->Stop();
  if (!text.ok()) return text.status();
  // Lines like "#   lane[0]:  3:tcp/lo.0 md[1] ... -> ... am am_bw#0": keep "tcp/lo".
  std::set<std::string> lanes;
  size_t pos = 0;
  while ((pos = text->find("lane[", pos)) != std::string::npos) {
    const size_t colon = text->find(':', pos);
    if (colon == std::string::npos) break;
    size_t start = text->find_first_not_of(' ', colon + 1);
    if (start == std::string::npos) break;
    const size_t num_end = text->find(':', start);
    const size_t eol = text->find('\n', start);
    if (num_end != std::string::npos && num_end < eol) start = num_end + 1;
    size_t end = text->find_first_of(" \n", start);
    std::string tl = text->substr(start, end - start);
    if (const size_t dot = tl.rfind('.'); dot != std::string::npos && tl.find('/') != std::string::npos &&
                                          dot > tl.find('/')) {
      tl.resize(dot);
    }
    if (!tl.empty()) lanes.insert(tl);
    pos = colon;
  }
  if (lanes.empty()) return std::string("(no lanes reported)");
  return absl::StrJoin(lanes, ", ");
}

}  // namespace kvshade::cli
