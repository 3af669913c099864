"""Every string the run prints, in Korean, the post's language: TEXT_KO by the keys of TEXT_EN,
and TEXT, both by --lang
"""
from nn40.text import SHARED_TEXT, TEXT_EN


TEXT_KO = {**SHARED_TEXT,
    "command": "명령: {command}", "device": "장치: {device}",
    "threads": ", torch 스레드 {threads}개",
    "model": "모델: {label}: {layers}층, 은닉 {hidden}, 헤드 {heads}개{kv}, {mlp_text} MLP "
             "{ffn:,}, 어휘 {vocab:,}, {dtype}: 매개변수 {params:,.1f} M개, {gib:.2f} GiB",
    "experts_line": "전문가 혼합: 층마다 전문가 {experts}개 (토큰당 {experts_per_token}개, 공유 "
                    "{shared_experts}개), 폭 {width:,}; 앞 {dense_layers}층은 밀집",
    "expert_skew": "; 라우팅 치우침 {expert_skew:g} (전문가 i를 i^-{expert_skew:g}에 비례해 고름)",
    "label_post": "글의 모델", "kv_heads": " (K/V 헤드 {n}개)", "mlp_gelu": "GELU",
    "mlp_gated": "게이트 SiLU",
    "card": "카드: {tp} x {name} (사양서 기준 {bandwidth:,.0f} GB/s, 밀집 FP16/BF16 {tflops:,.1f} "
            "TFLOP/s, {memory:g} GB, {link}); C는 {profile} 프로파일로 값을 매긴다 (대역폭의 "
            "{bandwidth_share:.0%}, FLOP/s의 최대 {matmul_share:.0%})",
    "card_ep": "; 레플리카마다 전문가를 나눠 가진 {ep}장 중 한 장 (어텐션은 데이터 병렬, MoE 층마다 "
               "all-to-all 두 번)",
    "slow_cpu": "참고: {name}을(를) 이 CPU에서 원래 크기로 돌린다 (가중치 {gib:.1f} GiB, 디코드 "
                "스텝마다 전부 읽음): 실험마다 몇 분씩 걸린다; --experiments C는 돌리지 않고 "
                "값만 매긴다",
    "model_post": "모델: 글의 대용 모델, 토큰마다 {hidden} x {hidden} 정사각 {dtype} 행렬곱 "
                  "{layers}개 (어텐션, KV 캐시, 정규화, 임베딩, LM 헤드 없음): 매개변수 "
                  "{params:,.1f} M개, {gib:.2f} GiB",
    "preset": "CPU 설정 (글의 모델은 실험마다 몇 분이 걸린다): {fields}",
    "dtype_probe": "자료형: {chosen}, 이 기계에서 측정해 가장 빠른 것 (실행이 쓰는 {rows}행의 "
                   "F.linear, 형식을 번갈아 {rounds}회; 실행이 시간을 쓰는 만큼 가중한 float32 "
                   "대비 시간: {ratios}; {margin}; float32가 {preference:g}배보다 더 빠르지 "
                   "않으면 2바이트 형식); --dtype으로 고를 수 있다",
    "probe_ratio": "{dtype} {median:.2f}배 (p10-p90 {p10:.2f}-{p90:.2f})",
    "probe_dropped": "{dtype} 탈락 (어느 크기에서 최고의 4배 넘음)",
    "probe_margin": "다음 후보는 {margin:.2f}배 뒤", "probe_alone": "다른 후보 없음",
    "probe_tied": "{types}와(과) {noise:.0%} 안에서 동률 (정해진 순서로 고름)",
    "layout_linear": "행렬곱: 모든 행 수에서 F.linear, W x^T는 잡음 이상으로 빠르지 않다 (측정, "
                     "{counts}행 ms: F.linear {linear}; W x^T {first})",
    "layout_probe": "행렬곱: {rows}행까지 W x^T, 그보다 많으면 F.linear (측정, {counts}행 ms: "
                    "F.linear {linear}; W x^T {first})",
    "ceilings": "한계: {bandwidth:,.1f} GB/s ({bandwidth_source}), {tflops:.2f} TFLOP/s "
                "({matmul_source}); 능선 {ridge} FLOP/byte",
    "cpu_graphs": "  (CPU: 즉시 실행만; CUDA 그래프는 CUDA에서만)",
    "given": "지정한 값", "measured_copy": "실측: {gib:.2f} GiB 복사",
    "measured_matmul": "실측: {n}x{n}x{n} {dtype} 행렬곱",
    "does_not_fit": "메모리 부족: {needed_gib:.2f} GiB 필요, {free_gib:.2f} GiB 남음",
    "A": "A  디코드 배치 크기 (문맥 {context}토큰)",
    "A_post": "A  디코드 배치 크기 (글의 대용 모델: KV 캐시 없음)",
    "A_contexts": "A  KV 캐시가 주도하는 지점: 디코드 한 스텝 ms ({mode})",
    "ctx_ms": "문맥 {context}: ms",
    "crossover": "KV 캐시 읽기가 가중치 읽기를 넘어서는 배치: {batches}",
    "crossover_at": "문맥 {context}에서 {batch}부터",
    "B": "B  프리필 대 디코드", "row": "한 스텝",
    "prefill": "프리필 (질문 {tokens}토큰)", "decode": "디코드 (묶음 {batch})",
    "mode": "방식", "batch": "배치 크기", "step_ms": "한 스텝 ms (= 대기)",
    "tokens_per_s": "처리량 (토큰/초)", "throughput_vs_1": "처리량 배율",
    "wait_vs_1": "대기 배율", "experts_touched": "읽은 전문가", "experts_expected": "기대 전문가",
    "dense_twin_ms": "밀집 쌍둥이 ms", "bytes_vs_1": "바이트 배율",
    "us_per_token": "토큰당 µs", "tflops": "실제 성능 TFLOP/s",
    "intensity": "산술 강도", "bound": "병목",
    "eager": "즉시 실행", "graph": "CUDA 그래프", "memory": "메모리", "compute": "계산",
    "launch": "커널 실행", "graph_failed": "즉시 실행 (그래프 실패)",
    "above_ceiling": "> 천장",
    "few_reps": "* 5번보다 적게 쟀다: 한 번의 호출이 모양마다 주어진 {budget:g}초의 5분의 1을 "
                "넘었다",
    "above_ceiling_note": "> 천장: 측정한 천장이 허락하는 것보다 빨리 돌았다. 그 천장(한 "
                          "모양에서 측정)이나 이 스텝의 계산이 틀렸으므로 비율을 싣지 "
                          "않는다",
    "launch_note": "커널 실행: 두 천장 모두의 {share:.0%}에 못 미친다. 메모리나 연산이 아니라 "
                   "커널 실행과 호스트 작업이 병목이다",
    "overhead": "오버헤드",
    "overhead_note": "오버헤드: 두 천장 모두의 {share:.0%}에 못 미친다. 메모리도 연산도 아닌, "
                     "이 모양에서 제 속도를 못 내는 CPU 행렬곱 라이브러리나 호스트 작업이 "
                     "병목이다",
    "kernels": "어텐션: {kernels} (허용: {backends}; 새 모양마다 계획을 세우는 것은 뺐다)",
    "view_too_large": "건너뜀: K/V 뷰가 {elements:,}개 원소로 {limit:,}를 넘는다 (32비트 "
                      "오프셋)",
    "out_of_memory": "건너뜀: 메모리 부족 ({error})",
    "chain": "같은 가중치 {mb:,.0f} MB를 읽는 맨 F.linear 연쇄 ({mode}, 배치 1): "
             "{ms:.3f} ms, {gbs:.1f} GB/s",
    "chain_decode": "; 배치 1 디코드는 {gbs:.1f} GB/s로 그 {share:.0%}",
    "C": "C  정적 대 연속 배칭 (요청 {requests}개, 슬롯 {slots}개)",
    "policy": "방식", "steps": "총 스텝", "occupancy": "슬롯 점유율",
    "static": "정적 배칭", "continuous": "연속 배칭", "chunked": "분할 프리필",
    "speedup": "속도 향상",
    "lengths": "{speedup}: {value:.2f}배   (생성 길이: 중앙값 {median:.0f}, 평균 {mean:.1f}, "
               "최대 {max:,})",
    "spread": "같은 분포에서 시드 {seeds}개로 뽑으면 p50 (p10-p90): 정적 {static}, "
              "연속 {continuous}, 속도 향상 {speedup}",
    "times": "배",
    "C_seconds": "C  초 단위: 요청 {requests:,}개 ({source}), 슬롯 {slots}개, "
                 "도착: {arrivals}",
    "step_costs": "   스텝 비용: {pricing}",
    "source_law": "글의 분포: floor(e^N({mu:g}, {sigma:g}^2)) <= {max:,}, 시드 {seed}",
    "source_trace": "트레이스 {name}", "arrivals_zero": "모두 t=0에",
    "arrivals_trace": "트레이스의 시각대로",
    "arrivals_poisson": "초당 {rate:g}개, 포아송",
    "arrivals_gamma": "초당 {rate:g}개, 감마 간격 (몰림 정도 {burstiness:g})",
    "pricing_analytic": "분석적 루프라인 ({bandwidth_gbs:,.0f} GB/s, {tflops:.3g} TFLOP/s, "
                        "{layers}x{hidden} {dtype})",
    "pricing_card": "{card}의 사양을 {profile} 프로파일로 매긴 값 (대역폭의 "
                    "{bandwidth_share:.0%}, FLOP/s의 최대 {matmul_share:.0%}, 패스당 "
                    "{step_us:.0f} us, 층당 {layer_us:.0f} us), {model}, 가중치 {weights}, KV {kv_dtype}, 카드 {tp}장",
    "pricing_measured": "{device}에서 실측 ({mode})",
    "pricing_stages": "{stages}, 파이프라인 {pp}단 (단마다 마이크로배치 하나)",
    "pricing_engine": "D를 위해 {device}에서 실측 (평균)",
    "seconds": "초", "req_s": "요청/초", "goodput": "유효 처리량 요청/초",
    "simulations": "모의실험 {runs}번 (위의 것, KV 실험, 누가 기다리나, 도착률 스윕): 루프 "
                   "{iterations:,}번을 "
                   "{seconds:,.2f}초에 (초당 {rate:,.0f}번), 작업 프로세스 {jobs}개로 "
                   "실제 {wall:,.2f}초",
    "orders_steps": "C  같은 표를 대기열 순서마다 (요청 {requests}개 모두 t=0에 대기; 끝: 요청이 "
                    "끝나는 스텝)",
    "order": "순서", "static_steps": "정적 스텝", "static_occ": "정적 점유율",
    "static_finish": "정적 평균 끝", "continuous_steps": "연속 스텝",
    "continuous_occ": "연속 점유율", "continuous_finish": "연속 평균 끝",
    "continuous_p99": "연속 p99 끝",
    "order_fcfs": "먼저 온 순서", "order_sjf": "짧은 것 먼저 (실제 길이)",
    "order_predicted": "예측이 짧은 것 먼저", "order_longest": "긴 것 먼저",
    "order_sjf_guarded": "짧은 것 먼저 + 보호",
    "order_predicted_guarded": "예측이 짧은 것 먼저 + 보호",
    "queue": "   대기열: {order}",
    "queue_predicted": " (길이 x e^N(0, {sigma:g}^2): 켄달 타우 {kendall_tau:.2f})",
    "queue_guard": "; {max_wait_s:g}초를 기다린 요청은 먼저",
    "who_waits": "C  누가 기다리나: 요청 {requests:,}개를 연속 배칭으로, 슬롯 {slots}개, "
                 "도착: {arrivals}, KV 캐시: {kv}",
    "who_waits_kv_none": "무제한 (모든 요청이 들어가는 할당 방식이 없음)",
    "who_waits_setup": "   예측 길이: 실제 x e^N(0, {sigma:g}^2), 켄달 타우 {tau:.2f}; 보호: "
                       "{guard:,.3g}초를 기다린 요청은 먼저 ({source})",
    "guard_flag": "--max-wait-s", "guard_fcfs": "먼저 온 순서에서 대기의 99번째 백분위",
    "stat_mean": "평균", "unit_s": "초",
    "per_token_ms": "출력 토큰당 ms", "longest_wait": "가장 긴 대기 초",
    "who_waits_by_length": "C  누가 기다리나, 출력 길이별 (이 작업량의 삼분위)",
    "output_tokens": "출력 토큰", "count": "요청 수",
    "bucket": "{name} {low:,}-{high:,}", "bucket_short": "짧음", "bucket_medium": "중간",
    "bucket_long": "긺",
    "kv_unfit_row": "{policy}: 들어가지 않아 모의실험하지 않음: {why}",
    "kv_no_memory": "가중치를 빼면 KV 캐시에 남는 메모리가 없다",
    "kv_short": "엔진의 규칙으로는 KV 캐시에 남는 것이 없다: 카드당 {short_gib:.2f} GiB 모자란다; "
                "{would}(으)로는 들어간다",
    "kv_max_output": "--max-output {max_output:,}이 가장 긴 출력 {longest:,}보다 작다",
    "kv_too_long": "요청 {request:,} 하나만으로 가장 길 때 {needs:,}토큰이 필요한데 (질문 {prompt:,} + "
                   "출력 {output:,}을 정책이 {block:,}토큰 블록으로 잡은 만큼) 예산은 {holds:,}토큰",
    "one_share": "   복제본 {replicas}개 중 하나의 몫 ({replicas}번째 요청마다, 라운드 로빈이 보내는 "
                 "대로); 아래의 복제본 표는 전부를 다룬다",
    "fleet": "C  슬롯 {slots}개짜리 복제본 {replicas}개를 라우터 뒤에: 요청 {requests:,}개, "
             "도착: {arrivals}, 연속 배칭, KV 캐시: {kv}",
    "router": "라우터", "slo_met": "SLO 충족", "per_replica": "복제본마다 요청",
    "busiest": "가장 바쁜 점유율",
    "capacity": "C  SLO에서의 처리 용량 ({slo}, 요청의 {attainment:.0%}): 복제본 하나가 초당 "
                "{rate}개 (출력 토큰 초당 {tokens:,.0f}개); 포아송 도착 {requests:,}개를 "
                "{seeds}번 뽑아서: {low}-{high}",
    "slo_ttft": "TTFT <= {ms:g} ms", "slo_tpot": "TPOT <= {ms:g} ms",
    "capacity_none": "없음", "capacity_all": "{rate:.3g} 넘게",
    "replicas_needed": "C  그 SLO에서 초당 {rate:g}개 요청에 필요한 복제본 (시도한 개수마다 "
                       "포아송 도착 {requests:,}개)",
    "replicas_col": "복제본", "attained_col": "그 개수에서 SLO 충족",
    "below_col": "하나 적을 때", "too_many": "{n:,}개 넘게",
    "router_plain": "{router}, 접두사 캐시 없이",
    "answer": "답: 복제본 {replicas} (GPU {gpus}), 라우터 {router}{tie}",
    "warn_moved": "경고: 이번 실행 동안 기계의 속도가 바뀌었다: 끝에서 다시 잰 천장이 "
                  "{bandwidth:,.1f}에서 {bandwidth_end:,.1f} GB/s로 ({bandwidth_moved:+.0%}), "
                  "{tflops:.3g}에서 {tflops_end:.3g} TFLOP/s로 ({tflops_moved:+.0%}), {share:.0%}"
                  "보다 크게 움직였다: 다른 무언가가 돌고 있었다. A, B, D의 시간은 믿을 수 없다: "
                  "조용한 기계에서 다시 돌리거나 --peak-bandwidth-gbs와 --peak-tflops를 주라",
    "warn_busy": "경고: {stages}이(가) 도는 동안 기계가 바빴다: 다른 프로세스가 CPU {cpus}개의 "
                 "{others:.0%}를 썼다{steal}, 그래서 그때 잰 것은 이 기계 본래보다 느리고 "
                 "흔들린다: 함께 도는 것 (브라우저, 빌드)을 닫고 다시 실행하라",
    "busy_steal": " (하이퍼바이저가 {steal:.0%}를 가져갔다)",
    "note_load": "참고: 이 시스템은 기계 전체의 CPU 시간을 주지 않아 (/proc/stat 없음) 다른 "
                 "프로그램이 {stages}을(를) 느리게 했는지 알 수 없다",
    "warn_ridge": "경고: 능선이 {ridge:.2g} FLOP/byte로 {least:g} 아래다: 행렬곱 천장이 그 바이트의 "
                  "복사보다 느렸다. 쉬는 CPU나 GPU에서는 없는 일이라 한계 열이 틀렸다: 조용한 "
                  "기계에서 --experiments AB를 다시 돌리거나 --peak-tflops를 주라",
    "warn_above": "경고: A와 B의 {rows}개 행에서 {shares}가 100%를 넘는다: 천장을 잴 때 기계가 "
                  "스텝을 돌릴 때보다 느렸다: 조용한 기계에서 --experiments AB를 다시 돌리거나 "
                  "--peak-bandwidth-gbs와 --peak-tflops를 주라",
    "warn_engine": "경고: D가 도는 동안 기계의 속도가 바뀌었다: {bandwidth:,.1f}에서 "
                   "{bandwidth_end:,.1f} GB/s ({bandwidth_moved:+.0%}), {tflops:.3g}에서 "
                   "{tflops_end:.3g} TFLOP/s ({tflops_moved:+.0%}): D의 판정은 다른 속도의 "
                   "기계에서 잰 비용과 실행을 비교한다: 조용한 기계에서 --experiments D를 다시 "
                   "돌리라",
    "verdict_machine_held": "D 동안 기계의 속도는 그대로였다: 비용을 재기 전부터 실행 뒤까지 "
                            "천장 {bandwidth_moved:+.0%} (대역폭), {tflops_moved:+.0%} (행렬곱) "
                            "(바뀜: 둘 다 한 방향으로 {share:.0%} 넘게, 또는 하나가 {alone:.0%} "
                            "넘게)",
    "verdict_machine_moved": "D의 비용 측정과 실행 사이에 기계의 속도가 바뀌었다: 천장 "
                             "{bandwidth_moved:+.0%} (대역폭), {tflops_moved:+.0%} (행렬곱), "
                             "{share:.0%} 넘게: 이 판정은 C가 아니라 기계의 것이다",
    "summary": "요약, 이번 실행에서 잰 그대로:",
    "summary_decode": "  1. 디코드는 바이트에 묶여 배칭이 거의 공짜다: 배치 {batch}는 배치 1의 "
                      "{throughput:.1f}배 토큰/s를 {wait:.2f}배 대기로 디코드한다 (배치 1: "
                      "{bound} 한계{turn})",
    "summary_decode_not": "  1. 여기서는 글과 달리 디코드 배칭이 거의 공짜가 아니었다: 배치 {batch}는 "
                          "배치 1의 {throughput:.1f}배 토큰/s를 {wait:.2f}배 대기로 디코드한다 "
                          "(배치 1: {bound} 한계{turn})",
    "summary_turn": "; 배치 {batch}부터 연산 한계",
    "summary_prefill": "  2. 프리필은 연산에 묶인다: 프롬프트 {tokens:,} 토큰, {intensity:.0f} "
                       "FLOP/byte ({bound} 한계)가 배치 1 디코드({decode:.1f} FLOP/byte)의 "
                       "{ratio:.0f}배 FLOP/s로 돌았다",
    "summary_prefill_not": "  2. 여기서는 글과 달리 프리필이 연산에 묶이지 않았다: 프롬프트 "
                           "{tokens:,} 토큰, {intensity:.0f} FLOP/byte로 이 기계의 능선 {ridge} "
                           "아래 ({bound} 한계), 배치 1 디코드({decode:.1f} FLOP/byte)의 "
                           "{ratio:.0f}배 FLOP/s로 돌았다",
    "summary_batching_not": "  3. 여기서는 글과 달리 연속 배칭이 앞서지 않았다: 슬롯-스텝의 "
                            "{continuous:.0%} 채움 대 정적 {static:.0%}, 스텝 {speedup:.2f}배"
                            "{engine}",
    "summary_batching": "  3. 연속 배칭은 정적 배칭이 비워 두는 자리를 채운다: 슬롯-스텝의 "
                        "{continuous:.0%} 채움 대 {static:.0%}, 스텝 {speedup:.2f}배 적음{engine}",
    "summary_engine": "; 실제 엔진에서 {measured:.2f}배 빠름 (C의 예측 {predicted:.2f}배)",
    "noun_replica": "{n:,}개|{n:,}개", "noun_gpu": "{n:,}장|{n:,}장",
    "answer_one": "답: {card}의 {model} 복제본 하나가 요청의 {attainment:.0%}에 {slo}를 "
                  "지키며 초당 {one}개 요청을 처리한다",
    "answer_fleet": "답: {card}의 {model} 복제본 {replicas} (GPU {gpus})가 요청의 "
                    "{attainment:.0%}에 {slo}를 지키며 초당 {rate:g}개 요청을 처리한다, 라우터 "
                    "{router} (복제본 하나는 초당 {one}개)",
    "answer_fleet_none": "답: {card}의 {model} 복제본 {n:,}개까지 어느 개수로도 요청의 "
                         "{attainment:.0%}에 {slo}를 지키며 초당 {rate:g}개 요청을 처리하지 "
                         "못한다",
    "answer_assumes": "  가정: {arrivals}; 프롬프트 {prompt:,.0f} 토큰, 출력 중앙값 "
                      "{output:,.0f}, 최대 {longest:,} ({source}); {limits}; 연속 배칭, KV 캐시 "
                      "{kv} (자세한 표는 아래)",
    "serving_limits": "복제본마다 시퀀스 {slots:,}개, 스텝마다 토큰 {chunk:,}개 ({source})",
    "limits_post": "글의 표와 같이", "limits_flag": "플래그대로",
    "limits_profile": "엔진 프로필대로", "limits_flag_too": ", 일부는 플래그대로",
    "limits_logged": "기록된 실행의 설정대로 (meta.json)",
    "limits_logged_too": ", 일부는 기록된 실행대로",
    "limits_vllm_large": "70 GiB 이상 카드에서 vllm serve의 기본값",
    "limits_vllm_small": "70 GiB 미만 카드나 A100에서 vllm serve의 기본값",
    "limits_sglang": "카드에 맞춘 SGLang의 기본값",
    "limits_sglang_drafting": "카드에 맞춘 SGLang의 기본값, 추측 디코딩 중에는 실행 48개",
    "answer_arrivals_poisson": "포아송 도착", "answer_post": "글의 모델",
    "answer_arrivals_gamma": "형상 {burstiness:g}의 감마 도착",
    "answer_tie": " (어느 라우터보다 적거나 같다)",
    "answer_none": "답: 복제본 {n:,}개까지 어느 개수로도 감당하지 못한다",
    "vllm_short_context": "C  vllm serve는 여기서 모델의 전체 컨텍스트 {context:,} 토큰 (기본 "
                          "--max-model-len: 그만큼 긴 요청 하나가 캐시에 들어가야 함)으로는 "
                          "시작하지 않습니다. 캐시가 {tokens:,} 토큰이므로 --max-model-len "
                          "{tokens:,} 이하로 시작하세요; C는 그렇게 시작한 엔진처럼 이 요청들을 "
                          "처리합니다",
    "vllm_short_max_model_len": "C  vllm serve는 기록된 실행의 --max-model-len {context:,} "
                                "(그만큼 긴 요청 하나가 캐시에 들어가야 함)으로는 여기서 "
                                "시작하지 않습니다. 캐시가 {tokens:,} 토큰이기 때문입니다; C는 "
                                "시작한 것처럼 이 요청들을 처리합니다",
    "kv": "C  KV 캐시: {gb:,.2f} GB ({memory_source}) = 토큰 {tokens:,}개 (토큰당 "
          "{bytes:,}바이트); 예약: 요청마다 질문 + 출력 {max_output:,}토큰; 페이지: "
          "{block}토큰 블록{admission}",
    "admit_watermark": ", 질문의 블록이 들어가고 {share:.0%}가 남을 때 받음",
    "admit_naive": ", 첫 스텝의 블록이 들어가면 받음",
    "memory_logged": "기록된 실행의 {tokens:,} 토큰 (meta.json)",
    "memory_cpu": "CPU 기본값",
    "memory_card": "{card} {tp}장 각각의 {total_gb:.1f} GB에서 가중치 {weights_gib:.2f} GiB와 "
                   "예약 {reserved_gb:g} GB를 뺀 값 x {fraction:g}",
    "memory_vllm": "{card} {tp}장 각각에 vLLM의 규칙, 드라이버가 보고하는 {total_gib:.2f} GiB "
                   "(판매 {sold_gb:g} GB): {fraction:g} x {total_gib:.2f} GiB에서 가중치 "
                   "{weights_gib:.2f} GiB, 스텝당 토큰 {tokens:,}개와 시퀀스 {seqs:,}개의 활성값 "
                   "{activation_gib:.2f} GiB, torch 밖의 {non_torch_gib:.2f} GiB를 뺀 값 = "
                   "{kv_gib:.2f} GiB",
    "memory_sglang": "{card} {tp}장 각각에 SGLang의 규칙, 드라이버가 보고하는 {total_gib:.2f} "
                     "GiB (판매 {sold_gb:g} GB): mem_fraction_static {fraction:g} x "
                     "({total_gib:.2f} GiB에서 CUDA 컨텍스트 {context_gib:.2f} GiB를 뺀 값)에서 "
                     "가중치 {weights_gib:.2f} GiB를 뺀 값 = {kv_gib:.2f} GiB",
    "memory_cuda": "{device}의 {total_gib:.2f} GiB x {fraction:g}에서 가중치 "
                   "{weights_gib:.2f} GiB를 뺀 값",
    "memory_reference": "글의 RTX 5080: {total_gb:g} GB x {fraction:g}에서 가중치 "
                        "{weights_gib:.2f} GiB를 뺀 값",
    "allocation": "할당", "reserve": "예약", "paged": "페이지",
    "prefix": "페이지 + 접두사 캐시", "radix": "기수 트리 캐시",
    "queried": "프롬프트 토큰", "hit_card": "적중",
    "hit_host": "호스트 적중", "hit_disk": "디스크 적중", "load_wait": "적재 대기 초",
    "prefill_computed": "프리필함", "prefill_saved": "프리필 안 함",
    "evicted": "축출된 블록", "found_cached": "캐시에서 찾은 프롬프트",
    "prefix_cache": "접두사 캐시 (계산한 것을 간직하는 페이지 블록; {host}): 입장 때 조회한 "
                    "프롬프트 토큰과 캐시에서 찾은 비율, 계층별",
    "prefix_host": "{link}({gbs:g} GB/s, 적재는 그 {share:.0%}) 너머 {gb:,.1f} GB "
                   "({tokens:,} 토큰)의 {write} 호스트 계층",
    "prefix_no_host": "호스트 계층 없음",
    "prefix_disk": "; 그 아래 {gbs:g} GB/s로 읽는 {gb:,.1f} GB ({tokens:,} 토큰)의 {write} 디스크 계층",
    "prefix_prefetch": ", 읽기는 요청이 도착할 때 시작",
    "prefix_by_hit": "입장 때 프롬프트 중 캐시에서 찾은 비율별 TTFT:",
    "hit_none": "없음", "hit_some": "절반 이하", "hit_most": "절반 초과",
    "wait_p99": "대기 p99 초", "tier": "캐시", "capacity_col": "카드 토큰",
    "tier_card": "카드", "tier_card_host": "카드 + 호스트", "tier_unlimited": "무제한",
    "tier_card_host_disk": "카드 + 호스트 + 디스크",
    "prefix_study_disk": "; 호스트 계층 아래 {tokens:,} 토큰의 디스크 계층",
    "tier_optimum": "하나씩", "unlimited": "무제한",
    "prefix_study": "용량에 따른 접두사 캐시 (연속 배칭; 카드 예산 {tokens:,} 토큰의 1/64에서 4배까지; "
                    "하나씩: 무제한 캐시에 요청을 하나씩 보낸 작업 부하 자체의 최적; "
                    "호스트 계층 {host:,} 토큰, {link} {gbs:g} GB/s): 계층별로 캐시에서 찾은 "
                    "프롬프트 토큰 비율과 TTFT",
    "prefix_capacity": "SLO에서 복제본 하나: 접두사 캐시로 초당 {cached:,.3g} 요청, 없이 "
                       "{plain:,.3g}.",
    "spec_head": "C  추측 디코딩: {method}, 한 단계에 초안 토큰 {k}개, 위치별 수락률 {rates} "
                 "({law}): 검증 단계 하나에 {length:.2f} 토큰; {draft}; 요청마다 자기 것 외에 "
                 "KV 토큰 {lookahead}개 (검증하는 초안과 vLLM의 lookahead); KV 캐시: {kv}",
    "spec_law_rates": "주어진 그대로", "spec_law_rate": "수락률 하나, 위치마다 그 거듭제곱",
    "spec_law_length": "평균 길이 하나, 그에 맞춘 수락률",
    "spec_law_default": "방법의 기본값: {source}",
    "spec_draft": "초안은 {model}, 같은 카드에서 한 단계에 {k}번",
    "spec_no_draft": "초안은 요청 자신의 텍스트에서 찾음 (CPU에서: 비용 없음)",
    "spec_memory": "카드마다 모델 옆의 초안: 자기 가중치 {weights:.2f} GiB, 토큰당 KV {kv:,.0f} "
                   "바이트 (vLLM은 같은 캐시에, SGLang은 따로 남겨 둔 메모리에 둔다); KV 캐시는 일반 "
                   "디코딩의 {plain} 토큰 대신 {spec} 토큰을 담는다.",
    "spec_plain": "일반 디코딩", "spec_run": "추측 디코딩",
    "spec_speedup": "이 부하에서 속도 향상: {x:.2f}배 (TPOT p50, 일반 대비 추측)",
    "spec_nothing": "첫 토큰 뒤로 디코딩하는 요청이 없다 (프리필이 그 토큰을 낸다): 추측할 것이 없다.",
    "spec_by_concurrency": "동시 요청 수별 속도 향상 (TPOT p50, 일반 대비 추측, 한 단계에 초안 k개; 그만큼의 "
                  "요청이 진행 중, 모두 t=0에 대기, 벤치마크 클라이언트가 유지하듯):",
    "spec_concurrency": "동시 요청", "spec_plain_tpot": "일반 TPOT p50 ms",
    "spec_k": "k={k}", "spec_best": "최선 k",
    "spec_crossover": "추측이 이득을 멈추는 곳: {each}",
    "spec_pays": "모든 동시 요청 수에서 이득", "spec_below_at": "{load}부터 1배 미만",
    "capacity_spec": "추측 디코딩 ({method}, k={k}): SLO에서 복제본 하나가 초당 {rate} 요청을 "
                     "처리{fleet}.",
    "capacity_spec_fleet": "; 목표 요청률에는 {router} 뒤에 {replicas} ({gpus}) 필요",
    "capacity_spec_none": "; 복제본 {n:,}개까지 어떤 구성도 목표 요청률을 처리하지 못함",
    "capacity_spec_only": "  (추측 디코딩: {method}, k={k}; 추측 없이는 복제본 하나에서 SLO를 "
                          "지키는 요청률이 없음)",
    "capacity_spec_misses": "추측 디코딩 ({method}, k={k}): 복제본 하나에서 SLO를 지키는 "
                            "요청률이 없음.",
    "concurrency": "동시 요청 최대 / 평균", "kv_used": "KV 사용률", "never_used": "안 쓰인 몫",
    "max_allocated": "최대 할당", "preempted": "선점", "recomputed": "재계산",
    "check_shape": "{rows:,}행 x {tokens:,}토큰 = {gb:.2f} GB",
    "check": "{device}에서: 예산만큼의 KV 캐시를 {shape}로 할당하고, 정점의 요청 {batch}개를 "
             "각자의 문맥에서 디코드 한 스텝 (최대 {max_context:,}{clamped}): {ms:.1f} ms",
    "check_clamped": ", {n}개는 행 길이로 자름",
    "check_skipped": "{device}에서: 예산만큼의 KV 캐시 ({shape}) {reason}",
    "D": "D  모델 위의 실제 엔진: 요청 {requests}개 ({source}: 출력 중앙값 {median:.0f}, 최대 "
         "{max:,}), 질문 {prompt}토큰, 슬롯 {slots}개, 그리디; 대기열: {order}; 도착: "
         "{arrivals}",
    "D_source": "글의 분포", "D_source_shrunk": "글의 분포, 출력 / {shrink}",
    "D_prefix_label": "연속 + 프리픽스 캐시",
    "D_prefix": "프리픽스 캐싱: 연속 배칭을 다시 돌리되 프롬프트의 K/V를 vLLM의 블록 풀처럼 블록 "
                "단위로 보관한다(시스템 프롬프트 {prefix_tokens}토큰): 프롬프트 토큰 {prompt_tokens:,}개 중 {hit_tokens:,}개를 "
                "캐시에서 찾음 (C의 PrefixCache: {hit_simulated:,}개; 요청별 적중이 C와 같은 요청: "
                "{requests}개 중 {hits_agree}개); 캐시 없이 돌린 실행과 그리디 토큰이 "
                "같은가: {identical}; C와 같은 스텝: {steps}; 아낀 시간 측정 {saved_s:,.2f}초, 예측 "
                "{saved_predicted_s:,.2f}초",
    "D_spec_label": "연속 + 추측 디코딩",
    "D_spec": "추측 디코딩: 연속 배칭을 다시 돌리되 디코더마다 마지막 토큰과 무작위 초안 {k}개를 "
              "한 패스로 검증하고, 같은 요청에 C가 뽑은 만큼 받아들인다 (vLLM의 합성 수락: "
              "비율 {rates}, 스텝당 E = {expected_length:.2f}토큰; 실제로 {emitted_per_step:.2f}"
              "토큰); C와 같은 스텝: {steps}; 연속 배칭 대비 속도 향상 측정 {measured:.2f}배, "
              "예측 {predicted:.2f}배",
    "D_pool": "블록 풀: 연속 배칭을 페이지 블록 {tokens:,}토큰 위에서 돌린다 (--kv-tokens), "
              "프리픽스 캐시 없는 vLLM처럼 아무것도 캐시하지 않는다: 선점 {preemptions:,}번 "
              "(C의 페이지 블록: {preemptions_simulated:,}번)",
    "D_prefix_preempted": "; 선점 {preemptions:,}번 (C: {preemptions_simulated:,}), 돌아와 자신의 "
                          "K/V를 다시 찾은 토큰 {readmitted_hit_tokens:,}개 (C: "
                          "{readmitted_hit_tokens_simulated:,}개)",
    "D_prefix_within": " ({off:+.0%}): {tolerance:.0%} 이내",
    "D_prefix_outside": " ({off:+.0%}): {tolerance:.0%} 밖",
    "D_cpu": "   CPU에서 D는 글의 분포를 줄여서 쓴다: CPU의 디코드 스텝은 배치가 8행쯤까지만 "
             "평평하고 (GPU는 100행 넘게), 짧은 출력은 실행을 짧게 한다 (--engine-requests, "
             "--engine-slots, --engine-shrink)",
    "D_bound": "   미리 잰 스텝 비용으로 두 실행에 {priced_s:,.0f}초로 값이 매겨져 D의 한도 "
               "{bound_s:.0f}초를 넘는다: 출력을 {shrunk_by}로 더 나눈다 ({priced_shrunk_s:,.0f}초)",
    "D_requests": "D  요청 하나하나: 같은 요청에 대한 C의 모의실험, 실행 자신의 패스로 값을 매긴 "
                  "것과 미리 잰 스텝 비용으로 매긴 것",
    "latency": "지연", "measured_col": "실측", "passes_col": "자신의 패스",
    "priced_col": "미리 잰 비용", "off_col": "차이",
    "lat_makespan_s": "전체 시간", "lat_ttft_p50_s": "TTFT p50", "lat_ttft_p90_s": "TTFT p90",
    "lat_e2e_p50_s": "E2E p50", "lat_e2e_p90_s": "E2E p90",
    "D_steps": "스텝: 첫 토큰과 마지막 토큰을 엔진과 C의 모의실험에서 같은 스텝에 내는 요청 "
               "{static} (정적), {continuous} (연속)",
    "D_steps_spec": "; 추측 디코딩: {speculative}",
    "D_steps_count": "{requests}개 중 {agree}개",
    "D_steps_mismatch": "; 처음 다른 요청: {request} ({policy}), 첫 토큰과 끝 스텝이 엔진에서 "
                        "{engine}, 모의실험에서 {simulated}",
    "D_steps_arrivals": "스텝: 비교하지 않음 (요청이 실제 시계로 도착)",
    "D_passes": "미리 잰 스텝 비용을 엔진의 {policy} 패스와 견주면: 디코드 {decode:+.0%} (패스 "
                "{n_decode:,}번), 프리필 {prefill:+.0%} ({n_prefill:,}번)",
    "verdict_steps": "판정: 모든 요청의 스텝이 정확히 같은가: {answer}",
    "verdict_prefix": "; 모든 요청의 접두사 캐시 적중(모두 t=0에 기다리면 스텝도)이 C와 같은가: "
                      "{answer}",
    "verdict_spec": "; 추측 디코딩의 속도 향상이 C의 {tolerance:.0%} 안인가: {answer}",
    "yes": "예", "no": "아니오", "not_checked": "확인 안 함 (도착 시각)",
    "verdict_seconds": "; {tolerance:.0%} 안의 초: 자신의 패스로 매긴 {checked}개 중 "
                       "{passes}개, 미리 잰 비용으로 매긴 {checked}개 중 {priced}개 (가장 큰 "
                       "차이 {mode}의 {metric}, {off:+.0%})",
    "D_predicted": "   예측: 같은 요청에 대한 C의 모의실험, 스텝 비용은 {pricing}",
    "wall_s": "실측 초", "predicted_s": "예측 초",
    "prefill_s": "프리필 초 (실측 / 예측)", "decode_s": "디코드 초 (실측 / 예측)",
    "between_s": "패스 사이 초",
    "attention_calls": "디코드 한 스텝의 층마다 어텐션 호출: 정적 {static:.1f}, "
                       "연속 {continuous:.1f}",
    "attention_spans": " (같은 위치의 행 묶음마다 한 번; 연속 배칭은 배치의 행들을 문맥에 고루 "
                       "흩어 행마다 한 번씩 잰 디코드 비용으로 매겼다)",
    "attention_padded": "; 연속 배칭의 디코드 {steps:,}스텝 중 {padded:,}스텝은 가장 긴 행에 "
                        "맞춰 채웠고, 그 값도 채운 채로 잰 디코드 비용으로 매겼다",
    "verdict": "{speedup}: 실측 {measured:.2f}배, 예측 {predicted:.2f}배 ({off:+.0%})",
    "verdict_within": ": {tolerance:.0%} 안",
    "verdict_outside": ": {tolerance:.0%} 밖; 가장 큰 차이는 {mode}의 {part}: "
                       "실측 {measured_s:.2f}초, 예측 {priced_s:.2f}초",
    "part_decode": "디코드 패스", "part_prefill": "프리필 패스",
    "part_host": "패스 사이의 호스트 작업 (스케줄링, 샘플링, 행 옮기기; C는 값을 매기지 않는다)",
    "catalog_kv_fraction": "가중치와 {reserved_gb:g} GB를 뺀 카드 메모리의 {fraction:g}에 "
                           "들어가는 KV 토큰",
    "catalog_kv_vllm": "vLLM의 규칙으로 들어가는 KV 토큰 (카드 메모리의 {fraction:g}에서 가중치, "
                       "카드에서 vllm serve 기본 한도의 활성값, torch 밖 메모리를 뺀 값)",
    "catalog_kv_sglang": "SGLang의 규칙으로 들어가는 KV 토큰 (카드에 맞춘 mem_fraction_static에서 "
                         "가중치를 뺀 값)",
    "catalog_kv_sglang_given": "SGLang의 규칙으로 들어가는 KV 토큰 (카드 메모리의 mem_fraction_static "
                               "{fraction:g}에서 가중치를 뺀 값)",
    "catalog": "이름 있는 모든 모델을 이름 있는 모든 카드에: {kv}; 디코드 스텝은 {name} 프로파일로 값을 "
               "매기고 (대역폭의 {bandwidth_share:.0%}, FLOP/s의 {matmul_share:.0%}, 패스당 "
               "{step_us:.0f} us, 층당 {layer_us:.0f} us), 행마다 {context:,}토큰",
    "model_col": "모델", "card_col": "카드", "weights_gb": "가중치 GB",
    "kv_per_token": "토큰당 KV 바이트", "kv_fit": "들어가는 KV 토큰",
    "crossover_col": "KV 읽기 > 가중치 읽기 배치", "decode_b1": "디코드 b1 ms",
    "decode_bn": "디코드 b{batch} ms", "no_fit": "들어가지 않음",
    "engine_run": "같은 요청을 실제 엔진이 처리한 기록과 C (엔진 설정: {settings}; C: 슬롯 {slots}, "
                  "스텝당 토큰 {chunk_tokens}, KV 토큰 {kv_tokens}, 도착: {rate})",
    "engine_measured": "엔진 (실측)", "engine_simulated": "C ({label})",
    "engine_error": "  오차", "run_col": "실행",
    # --validate
    "validation": "실제 엔진의 공개 측정값과 C ({validation}; 보정: {calibration}); "
                  "프로파일: {profiles}",
    "role_col": "역할", "source_col": "출처", "rows_col": "행", "median_abs_col": "|오차| 중앙값",
    "median_col": "오차 중앙값", "max_abs_col": "|오차| 최대", "within_col": "15% 이내",
    "tp_col": "TP", "weights_col": "가중치", "lengths_col": "배치 x 입력/출력",
    "metric_col": "지표", "published_col": "공개값", "predicted_col": "C", "error_col": "오차",
    "validation_worst": "C가 가장 많이 틀린 {n}개 행:",
    "validation_left": "C가 표현하지 못하는 행: {left}",
    # --calibrate
    "calibration": "실측 실행 {n}개로 보정한 C ({start} 프로필에서 시작): 실행마다 엔진이 잰 p50과 "
                   "C가 재현한 p50 (* 맞추지 않은 값)",
    "cal_measured_col": "실측 ms", "cal_start_col": "보정 전", "cal_fitted_col": "C ms",
    "cal_error_col": "오차", "cal_loo_col": "빼고 맞춤",
    "metric_ttft_s": "TTFT p50", "metric_tpot_s": "TPOT p50", "metric_e2e_s": "E2E p50",
    "calibration_fit": "맞춘 값: all-reduce는 링크 사양의 {link:.0%}, all-to-all은 {a2a:.0%}, "
                       "패스당 {step_ms:.2f} ms, 레이어당 "
                       "{layer_us:.1f} us, 대역폭의 {bandwidth:.0%}, FLOP/s의 {matmul:.0%}; "
                       "보정에 쓴 실행에서의 rms 오차 {rms:.1%}",
    "calibration_wrote": "저장: {path} (다시 쓰려면: --engine-profile {path})",
    "replay_cached": "{runs}: 엔진은 프리픽스를 캐시했지만 (설정에 그렇게 적혀 있음) 토큰 수만 "
                     "담은 기록으로는 프롬프트의 토큰을 알 수 없어, C는 어떤 프롬프트도 다른 "
                     "프롬프트와 블록을 공유하지 않는 것으로 재현합니다. 프롬프트가 실제로 블록 "
                     "전체를 공유했다면 엔진은 C의 재현보다 적게 계산했습니다",
    "distserve_replay": "DistServe가 기록한 실행 (OPT-13B, A100-80GB, ShareGPT)과 같은 배치, "
                        "같은 도착으로 돌린 C; 가격은 {profiles}만으로; SLO: TTFT <= 0.2 s, "
                        "TPOT <= 0.1 s",
    "file_col": "실행", "placement_col": "배치", "who_col": "", "slo_col": "SLO 충족",
    "measured": "측정", "simulated": "C",
    "placement_search": "A100-80GB 최대 {budget}장 위 OPT-13B 배치, 카드당 goodput 순 (ShareGPT "
                        "요청 {requests}개의 90%가 TTFT <= 0.2 s, TPOT <= 0.1 s를 지키는 최대 "
                        "도착률, DistServe 엔진 프로파일)",
    "placement_timing": "시뮬레이션 {simulations:,}회, 회당 {p50_ms:,.0f} ms (p10 {p10_ms:,.0f}, "
                        "p90 {p90_ms:,.0f}), {where}에서 {wall_s:.1f} s (시작 "
                        "{start_s:.1f} s): 평균 {busy:.2f}개가 바쁨",
    "on_workers": "작업 프로세스 {workers}개", "on_dask": "Dask 클러스터 {cluster}",
    "placement_best": "종류별 최선: {best}",
    "pools": "C  카드 {gpus}장 위의 분리 서빙과, 온전한 복제본이 차지하는 만큼의 카드({colocated_gpus}장) "
             "위의 함께 놓인 복제본: 요청 {requests:,}개, "
             "풀마다 자기 카드 위의 엔진 한도와 KV 캐시; 분리: {disaggregated}; 함께: {colocated}",
    "kind_col": "종류", "kind_disaggregated": "분리", "kind_colocated": "함께",
    "pool_col": "풀", "replicas_col": "복제본", "busy_col": "바쁨", "wait_col": "대기 s",
    "placements": "C  {rate:g} 요청/s를 SLO({slo})로 요청의 {attainment:.0%}에 서비스하는 가장 "
                  "싼 배치 (시뮬레이션마다 도착 {requests:,}개): 모양마다 가장 적은 복제본 수를 "
                  "TensorRT-LLM의 속도 맞춤 규칙에서 출발해 시뮬레이션으로 탐색 (규칙: prefill + "
                  "decode 복제본)",
    "placements_timing": "시뮬레이션 {simulations:,}회, 평균 회당 {each_ms:,.0f} ms, "
                         "{where}에서 {wall_s:.1f} s",
    "placement_none": "{shapes}: SLO를 지키는 수 없음",
    "placement_skipped": "{shapes}: 건너뜀 (한가해도 SLO를 못 지키거나 예산 초과)", "rule_col": "규칙",
    "placements_none": "답: 탐색한 어떤 배치도 이 속도를 SLO로 서비스하지 못함",
    "placements_answer": "답: {kind}, {placement}: {cards}, SLO 충족 {attainment:.1%}",
    "placements_other": "가장 나은 {kind}: {placement}, {cards} (같은 속도에 카드 {more:+d}장, SLO 충족 "
                        "{attainment:.1%})",
    "placements_other_none": "다른 종류의 배치로는 이 속도를 SLO로 서비스하지 못함",
    "rate_matching": "그 쌍의 속도 맞춤 규칙: prefill 복제본 하나가 {context_rps:,.3g} 요청/s를 "
                     "prefill, decode 복제본 하나가 {generation_rps:,.3g} 요청/s를 끝냄 (배치 "
                     "{batch:,}, 스텝 {ms:,.1f} ms): 복제본 {prefill_replicas} + "
                     "{decode_replicas}, 카드 {gpus}장, 카드당 출력 {output_tokens_per_s_per_gpu:,.0f} "
                     "토큰/s",
    "pools_kv": "대기 s: prefill은 첫 스텝까지의 p90 대기, decode는 복제본에 자리가 날 때까지의 "
                "평균 대기 (역압: 요청 {waited:,}개가 기다림, 모두 {wait_s:,.2f} s). 옮긴 KV: "
                "{gb:,.2f} GB, 전송 {sends:,}회, {link} ({gbs:g} GB/s, {us:g} us), 평균 전송 "
                "{ms:,.3f} ms",
    "gpus_col": "카드", "goodput_col": "goodput 요청/s", "per_gpu_col": "카드당 요청/s",
    "simulations_col": "시뮬레이션", "search_col": "탐색 s",
    "wrote": "저장: {json}, 그림 {figures}", "wrote_json": "저장: {json}",
    "older_figures": "이전 실행의 그림 유지 (이번 실행은 그리지 않음): {figures}",
    "interrupted": "중단됨: 위의 표는 끝난 실험들이다",
}
TEXT = {"en": TEXT_EN, "ko": TEXT_KO}
