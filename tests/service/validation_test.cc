// Input validation: a table of malformed requests, each with the gRPC code it must get and
// a word its message must contain; afterwards the good session still answers the same.
#include <functional>

#include "absl/strings/str_cat.h"
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace validation_test {
namespace {

struct Case {
  std::string name;
  absl::StatusCode code;
  std::string needle;  // part of the message naming the problem
  std::function<absl::Status()> run;
};

TEST(ValidationTest, MalformedRequestsGetTheFittingCode) {
  Harness hx;
  hx.config.limits.max_tokens_per_session = 5000;
  hx.config.limits.max_batch = 4;
  hx.Restart();
  Stream s = MakeStream(300, hx.model, 51);
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_rank(64);
  auto good = hx.Open(s, p);
  const auto q = hx.Query(1);
  auto before = hx.Attend(good.attachment, 1, q);
  ASSERT_TRUE(before.ok());

  // A session still ingesting, for ingest and select cases.
  v1::CreateSessionRequest base;
  *base.mutable_model() = hx.model;
  *base.mutable_profile() = ProfileOf(v1::PROFILE_KIND_EXACT);
  base.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.begin() + 50);
  auto pending = hx.engine->CreateSession(hx.tenant, base);
  ASSERT_TRUE(pending.ok());
  const std::string pid = pending->session_id();
  const std::string pending_att = hx.AttachTo(pid);
  const auto good_stream = IngestStreamOf(pid, s, 0, 50);

  auto create = [&](std::function<void(v1::CreateSessionRequest&)> edit) {
    return [&, edit] {
      v1::CreateSessionRequest r = base;
      edit(r);
      return hx.engine->CreateSession(hx.tenant, r).status();
    };
  };
  auto ingest = [&](std::function<void(std::vector<v1::IngestRequest>&)> edit) {
    return [&, edit] {
      auto msgs = good_stream;
      edit(msgs);
      return hx.engine->Ingest(hx.tenant, msgs).status();
    };
  };
  auto select = [&](std::function<void(v1::SelectAndReconstructRequest&)> edit) {
    return [&, edit] {
      v1::SelectAndReconstructRequest r;
      r.set_layer(0);
      auto* sq = r.add_queries();
      sq->set_attachment_id(good.attachment);
      *sq->mutable_q() = ToTensor(q, {4, 64});
      edit(r);
      return hx.engine->SelectAndReconstruct(hx.tenant, r).status();
    };
  };
  auto append = [&](std::function<void(v1::AppendTokensRequest&)> edit) {
    return [&, edit] {
      v1::AppendTokensRequest r;
      r.set_session_id(good.session);
      r.add_token_ids(7);
      for (int l = 0; l < 2; ++l) {
        auto* lk = r.add_layers();
        lk->set_layer(l);
        *lk->mutable_k() = ToTensor(std::vector<bf16>(128, kernels::FloatToBf16(0.5f)), {1, 2, 64});
        *lk->mutable_v() = ToTensor(std::vector<bf16>(128, kernels::FloatToBf16(0.5f)), {1, 2, 64});
      }
      edit(r);
      return hx.engine->AppendTokens(hx.tenant, r).status();
    };
  };
  using C = absl::StatusCode;
  const std::vector<Case> cases = {
      {"no model", C::kInvalidArgument, "model", create([](auto& r) { r.clear_model(); })},
      {"zero layers", C::kInvalidArgument, "num_layers",
       create([](auto& r) { r.mutable_model()->set_num_layers(0); })},
      {"gqa mismatch", C::kInvalidArgument, "num_query_heads",
       create([](auto& r) { r.mutable_model()->set_num_query_heads(3); })},
      {"odd head dim", C::kInvalidArgument, "head_dim",
       create([](auto& r) { r.mutable_model()->set_head_dim(63); })},
      {"head dim over limit", C::kInvalidArgument, "head_dim",
       create([](auto& r) { r.mutable_model()->set_head_dim(512); })},
      {"int32 model dtype", C::kInvalidArgument, "dtype",
       create([](auto& r) { r.mutable_model()->set_dtype(v1::DTYPE_INT32); })},
      {"nan rope theta", C::kInvalidArgument, "theta",
       create([](auto& r) { r.mutable_model()->mutable_rope()->set_theta(NAN); })},
      {"no tokens", C::kInvalidArgument, "token_ids", create([](auto& r) { r.clear_token_ids(); })},
      {"negative token", C::kInvalidArgument, "token_ids[3]",
       create([](auto& r) { r.set_token_ids(3, -5); })},
      {"too many tokens", C::kResourceExhausted, "max_tokens_per_session",
       create([](auto& r) { for (int i = 0; i < 5000; ++i) r.add_token_ids(1); })},
      {"rank not multiple of 8", C::kInvalidArgument, "rank", create([](auto& r) {
         r.mutable_profile()->set_kind(v1::PROFILE_KIND_SHADOW);
         r.mutable_profile()->set_rank(20);
       })},
      {"rank over h*d", C::kInvalidArgument, "rank", create([](auto& r) {
         r.mutable_profile()->set_kind(v1::PROFILE_KIND_SHADOW);
         r.mutable_profile()->set_rank(256);
       })},
      {"shadow prompt too short", C::kInvalidArgument, "local_window", create([](auto& r) {
         r.mutable_profile()->set_kind(v1::PROFILE_KIND_SHADOW);
         r.mutable_token_ids()->Truncate(10);
       })},
      {"bad ratio", C::kInvalidArgument, "mini_recent_ratio",
       create([](auto& r) { r.mutable_profile()->set_mini_recent_ratio(1.5f); })},
      {"label too long", C::kInvalidArgument, "label",
       create([](auto& r) { r.set_label(std::string(300, 'x')); })},
      {"durable without spill tier", C::kFailedPrecondition, "spill",
       create([](auto& r) { r.set_durable(true); })},
      {"stream without header", C::kInvalidArgument, "IngestHeader",
       ingest([](auto& m) { m.erase(m.begin()); })},
      {"ingest unknown session", C::kNotFound, "not found",
       ingest([](auto& m) { m[0].mutable_header()->set_session_id("nope"); })},
      {"ingest other layer", C::kInvalidArgument, "num_layers",
       ingest([](auto& m) { m[1].mutable_layer()->set_layer(9); })},
      {"ingest wrong shape", C::kInvalidArgument, "shape",
       ingest([](auto& m) { m[1].mutable_layer()->mutable_k()->set_shape(2, 32); })},
      {"ingest wrong dtype", C::kInvalidArgument, "dtype",
       ingest([](auto& m) { m[1].mutable_layer()->mutable_v()->set_dtype(v1::DTYPE_FP32); })},
      {"ingest short data", C::kInvalidArgument, "bytes",
       ingest([](auto& m) { m[1].mutable_layer()->mutable_k()->mutable_data()->resize(10); })},
      {"ingest nan", C::kInvalidArgument, "non-finite", ingest([](auto& m) {
         (*m[1].mutable_layer()->mutable_k()->mutable_data())[1] = static_cast<char>(0x7f);
         (*m[1].mutable_layer()->mutable_k()->mutable_data())[0] = static_cast<char>(0xc0);
       })},
      {"ingest parts out of order", C::kInvalidArgument, "token_offset",
       ingest([](auto& m) { std::swap(m[1], m[2]); })},
      {"commit before layers", C::kInvalidArgument, "incomplete layers: [1]",
       ingest([](auto& m) { m.erase(m.begin() + 3, m.begin() + 5); })},
      {"attach unknown session", C::kNotFound, "not found",
       [&] {
         v1::AttachRequest r;
         r.set_session_id("0123");
         return hx.engine->Attach(hx.tenant, r).status();
       }},
      {"attach lease too long", C::kInvalidArgument, "max_lease_ms",
       [&] {
         v1::AttachRequest r;
         r.set_session_id(good.session);
         r.set_lease_ms(10'000'000);
         return hx.engine->Attach(hx.tenant, r).status();
       }},
      {"attach worker id too long", C::kInvalidArgument, "worker_id",
       [&] {
         v1::AttachRequest r;
         r.set_session_id(good.session);
         r.set_worker_id(std::string(200, 'w'));
         return hx.engine->Attach(hx.tenant, r).status();
       }},
      {"select unknown attachment", C::kNotFound, "queries[0]",
       select([](auto& r) { r.mutable_queries(0)->set_attachment_id("x"); })},
      {"select layer out of range", C::kInvalidArgument, "layer",
       select([](auto& r) { r.set_layer(2); })},
      {"select query shape", C::kInvalidArgument, "queries[0].q.shape",
       select([](auto& r) { r.mutable_queries(0)->mutable_q()->set_shape(0, 2); })},
      {"select duplicate attachment", C::kInvalidArgument, "more than once",
       select([](auto& r) { *r.add_queries() = r.queries(0); })},
      {"select over max batch", C::kInvalidArgument, "max_batch", select([](auto& r) {
         for (int i = 0; i < 4; ++i) *r.add_queries() = r.queries(0);
       })},
      {"select on an ingesting session", C::kFailedPrecondition, "ingesting",
       select([&](auto& r) { r.mutable_queries(0)->set_attachment_id(pending_att); })},
      {"append missing layer", C::kInvalidArgument, "num_layers",
       append([](auto& r) { r.mutable_layers()->RemoveLast(); })},
      {"append duplicate layer", C::kInvalidArgument, "distinct",
       append([](auto& r) { r.mutable_layers(1)->set_layer(0); })},
      {"append token count mismatch", C::kInvalidArgument, "shape",
       append([](auto& r) { r.add_token_ids(8); })},
      {"append infinite value", C::kInvalidArgument, "non-finite", append([](auto& r) {
         (*r.mutable_layers(0)->mutable_v()->mutable_data())[1] = static_cast<char>(0x7f);
         (*r.mutable_layers(0)->mutable_v()->mutable_data())[0] = static_cast<char>(0x80);
       })},
      {"append to unknown session", C::kNotFound, "not found",
       append([](auto& r) { r.set_session_id("zzz"); })},
      {"append with unknown attachment", C::kNotFound, "not found",
       append([](auto& r) { r.set_attachment_id("zzz"); })},
      {"static set layer", C::kInvalidArgument, "layer",
       [&] {
         v1::GetStaticSetRequest r;
         r.set_attachment_id(good.attachment);
         r.set_layer(5);
         return hx.engine->GetStaticSet(hx.tenant, r).status();
       }},
      {"fork unknown parent", C::kNotFound, "not found",
       [&] {
         v1::ForkSessionRequest r;
         r.set_parent_session_id("nope");
         return hx.engine->ForkSession(hx.tenant, r).status();
       }},
      {"fork inside a segment", C::kInvalidArgument, "at_token",
       [&] {
         v1::ForkSessionRequest r;
         r.set_parent_session_id(good.session);
         r.set_at_token(17);
         return hx.engine->ForkSession(hx.tenant, r).status();
       }},
      {"fork an ingesting session", C::kFailedPrecondition, "ingesting",
       [&] {
         v1::ForkSessionRequest r;
         r.set_parent_session_id(pid);
         r.set_at_token(50);
         return hx.engine->ForkSession(hx.tenant, r).status();
       }},
      {"detach unknown", C::kNotFound, "not found",
       [&] {
         v1::DetachRequest r;
         r.set_attachment_id("abc");
         return hx.engine->Detach(hx.tenant, r).status();
       }},
      {"close other tenant's session", C::kNotFound, "not found",
       [&] {
         v1::CloseSessionRequest r;
         r.set_session_id(good.session);
         return hx.engine->CloseSession(hx.other, r).status();
       }},
  };
  for (const Case& c : cases) {
    const absl::Status st = c.run();
    EXPECT_EQ(st.code(), c.code) << c.name << ": " << st;
    EXPECT_NE(st.message().find(c.needle), std::string::npos)
        << c.name << ": message '" << st.message() << "' does not mention '" << c.needle << "'";
  }
  // None of it touched the good session, and the pending one can still be ingested.
  auto after = hx.Attend(good.attachment, 1, q);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(std::memcmp(after->data(), before->data(), before->size() * 4), 0);
  v1::GetSessionRequest gr;
  gr.set_session_id(good.session);
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, gr)->tokens(), 300u);
  EXPECT_TRUE(hx.engine->Ingest(hx.tenant, good_stream).ok());
}


TEST(ValidationTest, IdsOverTheLimitAreRefusedAndEchoedIdsAreBounded) {
  Harness hx;
  Stream s = MakeStream(64, hx.model, 52);
  auto good = hx.Open(s, ProfileOf(v1::PROFILE_KIND_EXACT));
  const std::string huge(10 << 10, 'x');
  using C = absl::StatusCode;
  struct IdCase {
    std::string name;
    C code;
    std::function<absl::Status()> run;
  };
  const std::vector<IdCase> cases = {
      {"get", C::kInvalidArgument,
       [&] {
         v1::GetSessionRequest r;
         r.set_session_id(huge);
         return hx.engine->GetSession(hx.tenant, r).status();
       }},
      {"close", C::kInvalidArgument,
       [&] {
         v1::CloseSessionRequest r;
         r.set_session_id(huge);
         return hx.engine->CloseSession(hx.tenant, r).status();
       }},
      {"fork", C::kInvalidArgument,
       [&] {
         v1::ForkSessionRequest r;
         r.set_parent_session_id(huge);
         return hx.engine->ForkSession(hx.tenant, r).status();
       }},
      {"attach", C::kInvalidArgument,
       [&] {
         v1::AttachRequest r;
         r.set_session_id(huge);
         return hx.engine->Attach(hx.tenant, r).status();
       }},
      {"detach", C::kInvalidArgument,
       [&] {
         v1::DetachRequest r;
         r.set_attachment_id(huge);
         return hx.engine->Detach(hx.tenant, r).status();
       }},
      {"static set", C::kInvalidArgument,
       [&] {
         v1::GetStaticSetRequest r;
         r.set_attachment_id(huge);
         return hx.engine->GetStaticSet(hx.tenant, r).status();
       }},
      {"attend", C::kInvalidArgument, [&] { return hx.Attend(huge, 0, hx.Query(1)).status(); }},
      {"ingest", C::kInvalidArgument,
       [&] {
         v1::IngestRequest h;
         h.mutable_header()->set_session_id(huge);
         return hx.engine->BeginIngest(hx.tenant, h).status();
       }},
      {"append: attachment", C::kInvalidArgument,
       [&] {
         v1::AppendTokensRequest r;
         r.set_session_id(good.session);
         r.set_attachment_id(huge);
         r.add_token_ids(7);
         for (int l = 0; l < 2; ++l) {
           auto* lk = r.add_layers();
           lk->set_layer(l);
           *lk->mutable_k() = ToTensor(std::vector<bf16>(128, kernels::FloatToBf16(0.5f)), {1, 2, 64});
           *lk->mutable_v() = ToTensor(std::vector<bf16>(128, kernels::FloatToBf16(0.5f)), {1, 2, 64});
         }
         return hx.engine->AppendTokens(hx.tenant, r).status();
       }},
      {"slots", C::kInvalidArgument, [&] { return hx.engine->AttachmentSlots(hx.tenant, huge).status(); }},
      // At the limit but unknown: NOT_FOUND, naming a bounded piece of the id and its length.
      {"get: 128-byte unknown id", C::kNotFound,
       [&] {
         v1::GetSessionRequest r;
         r.set_session_id(std::string(128, 'x'));
         return hx.engine->GetSession(hx.tenant, r).status();
       }},
  };
  for (const IdCase& c : cases) {
    const absl::Status st = c.run();
    EXPECT_EQ(st.code(), c.code) << c.name << ": " << st.message().substr(0, 200);
    EXPECT_LE(st.message().size(), 256u) << c.name;
    EXPECT_EQ(st.message().find(std::string(65, 'x')), std::string_view::npos) << c.name;
  }
  v1::GetSessionRequest r;
  r.set_session_id(std::string(100, 'y'));
  const absl::Status st = hx.engine->GetSession(hx.tenant, r).status();
  EXPECT_NE(st.message().find(absl::StrCat(std::string(64, 'y'), "...")), std::string_view::npos) << st;
  EXPECT_NE(st.message().find("100 bytes"), std::string_view::npos) << st;
  // Ids of normal length are echoed whole.
  r.set_session_id("nope");
  EXPECT_NE(hx.engine->GetSession(hx.tenant, r).status().message().find("'nope'"), std::string_view::npos);
}

}  // namespace
}  // namespace validation_test
}  // namespace kvshade::service::testing
