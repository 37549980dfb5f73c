// The v1 message form of the decode path (engine.h): SelectAndReconstruct and Attend
// requests become decode.h views over the messages' own bytes (no copy), and results
// become v1 responses. The gRPC service calls these; the UCX data plane speaks binary
// frames (transport/frame.h) and never builds a message on this path.
#include "absl/strings/str_cat.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/service/engine.h"
#include "kvshade/service/model.h"

namespace kvshade::service {

absl::StatusOr<v1::SelectAndReconstructResponse> Engine::SelectAndReconstruct(
    const Tenant& t, const v1::SelectAndReconstructRequest& r) {
  std::vector<SelectQueryView> qs(r.queries_size());
  for (int i = 0; i < r.queries_size(); ++i) {
    const v1::SelectQuery& q = r.queries(i);
    qs[i].attachment_id = q.attachment_id();
    qs[i].q = ViewOf(q.q());
    qs[i].chunks = ViewOf(q.chunks());
    qs[i].k_new = ViewOf(q.k_new());
    qs[i].v_new = ViewOf(q.v_new());
    qs[i].stage = q.has_stage_token_id();
    qs[i].stage_token_id = q.stage_token_id();
    qs[i].hold = q.stage_hold();
    qs[i].purpose = q.purpose();
  }
  SelectResult res;
  KVSHADE_RETURN_IF_ERROR(Select(t, SelectRequestView{r.layer(), qs}, &res));
  v1::SelectAndReconstructResponse resp;
  for (size_t i = 0; i < res.deltas.size(); ++i) {
    const SlotDeltaResult& d = res.deltas[i];
    v1::SlotDelta* out = resp.add_deltas();
    out->set_attachment_id(r.queries(static_cast<int>(i)).attachment_id());
    for (uint32_t x = 0; x < d.misses(); ++x) {
      out->add_head(d.head[x]);
      out->add_slot(d.slot[x]);
      out->add_chunk(d.chunk[x]);
      out->add_position(d.position[x]);
    }
    // Delivered rows keep their shape and carry no data (as the worker reads them).
    const int64_t shape[3] = {int64_t(d.misses()), d.chunk_size, d.head_dim};
    EncodeBf16(d.keys, shape, out->mutable_keys());
    EncodeBf16(d.values, shape, out->mutable_values());
    out->set_delivered(d.delivered);
    out->set_fallback(d.fallback);
    out->set_selected(d.selected);
    out->set_hits(d.hits);
    out->set_tokens(d.tokens);
    out->set_slot_tokens(d.chunk_size);
  }
  return resp;
}

absl::StatusOr<v1::AttendResponse> Engine::Attend(const Tenant& t, const v1::AttendRequest& r) {
  std::vector<AttendQueryView> qs(r.queries_size());
  for (int i = 0; i < r.queries_size(); ++i) {
    const v1::AttendQuery& q = r.queries(i);
    qs[i].attachment_id = q.attachment_id();
    qs[i].q = ViewOf(q.q());
    qs[i].k_new = ViewOf(q.k_new());
    qs[i].v_new = ViewOf(q.v_new());
    qs[i].stage = q.has_stage_token_id();
    qs[i].stage_token_id = q.stage_token_id();
    qs[i].hold = q.stage_hold();
  }
  AttendResult res;
  KVSHADE_RETURN_IF_ERROR(Attend(t, AttendRequestView{r.layer(), qs}, &res));
  v1::AttendResponse resp;
  for (size_t i = 0; i < res.outputs.size(); ++i) {
    const int64_t hq = static_cast<int64_t>(res.lse[i].size());
    const int64_t out_shape[2] = {hq, hq > 0 ? static_cast<int64_t>(res.outputs[i].size()) / hq : 0};
    const int64_t lse_shape[1] = {hq};
    EncodeF32(res.outputs[i], out_shape, resp.add_outputs());
    EncodeF32(res.lse[i], lse_shape, resp.add_lse());
    resp.add_tokens(res.tokens[i]);
  }
  return resp;
}

}  // namespace kvshade::service
